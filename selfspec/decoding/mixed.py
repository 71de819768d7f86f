"""Rows of one round drafting with different drafters, verified in one pass.

Continuous batching gives each request its own bucket's drafter (int4 here, the hybrid there). Every
drafter but the early exit verifies from layer 0, so their rows can share the round's verification
pass; and a hybrid's rows that lookup cannot serve draft with its fallback, which is the engine's
int4 drafter itself, so they share that drafter's passes too. Without this, each drafter's rows would
run a round of their own: γ draft passes and a verification pass each."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ..model.cache import PagedKVCache
from ..model.decoder import DecoderModel
from .drafter import Draft, Drafter
from .hybrid import HybridDrafter

if TYPE_CHECKING:
    from .round import RoundInput


class MixedDrafter(Drafter):
    name = "mixed"

    def __init__(self, drafters: list[Drafter], rows: list[int]) -> None:
        if any(d.resumes for d in drafters):
            raise ValueError("mixed drafters must all verify from layer 0, not resume mid-model (an early exit)")
        self.drafters, self.rows = drafters, rows  # rows[b]: the index of row b's drafter

    def describe(self) -> dict:
        return {"drafter": self.name, "drafters": [d.describe() for d in self.drafters]}

    def propose(self, model: DecoderModel, cache: PagedKVCache, step: RoundInput) -> Draft:
        tokens: list[list[int]] = [[] for _ in step.seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in step.seqs]
        owner: list[Drafter | None] = [self.drafters[r] for r in self.rows]  # who drafts each row
        for hybrid in (d for d in self.drafters if isinstance(d, HybridDrafter)):
            found, rest = hybrid.looked_up(replace(step, gammas=self._gammas(step, owner, hybrid)))
            for b, g in enumerate(rest):
                if found.tokens[b]:
                    tokens[b], probs[b] = found.tokens[b], found.probs[b]
                if g:  # lookup had no match: the hybrid's fallback drafts this row with its own rows
                    owner[b] = hybrid.fallback
        for drafter in dict.fromkeys(d for d in owner if d is not None and not isinstance(d, HybridDrafter)):
            draft = drafter.propose(model, cache, replace(step, gammas=self._gammas(step, owner, drafter)))
            for b in range(len(owner)):
                if owner[b] is drafter:
                    tokens[b], probs[b] = draft.tokens[b], draft.probs[b]
        return Draft(tokens, probs)

    @staticmethod
    def _gammas(step: RoundInput, owner: list[Drafter | None], drafter: Drafter) -> list[int]:
        """The step's γ for `drafter`'s rows, 0 elsewhere (a row with γ 0 costs a drafter nothing)."""
        return [g if owner[b] is drafter else 0 for b, g in enumerate(step.gammas)]
