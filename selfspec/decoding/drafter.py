"""The drafter seam: every draft source proposes up to γ tokens per row behind one interface, and
the round verifies whatever it proposed with the same acceptance rule.

A drafter returns a `Draft`: the proposed tokens, the draft distribution q of each sampled position
(the acceptance rule needs q, not just the token), and optionally the hidden states of the verify
inputs [last, d_1 .. d_γ] at some layer, so that verification resumes there instead of at layer 0
(an early exit has already run layers [0, N) over exactly those tokens).

`ExitDrafter` is the plain early exit: layers [0, N), then the final norm and LM head."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..model.attention import AttentionBatch
from ..model.cache import PagedKVCache
from ..model.decoder import DecoderModel
from .sampling import sample_rows

if TYPE_CHECKING:
    from .round import RoundInput


@dataclass
class Draft:
    tokens: list[list[int]]  # per row: d_1 .. d_γb (γ_b <= the row's cap; [] for plain rows)
    probs: list[list[torch.Tensor]]  # per row: q_i [vocab] per draft token (empty for greedy rows)
    hidden: torch.Tensor | None = None  # [B, γ_max + 1, hidden] of [last, d_1 ..] entering layer `resume`
    resume: int = 0  # the layer verification starts at (0: from the tokens themselves)


class Drafter(ABC):
    """One draft source. `propose` may write K/V of the draft positions into the cache (the
    verification pass overwrites or reuses them; the round's rollback truncates the rest)."""

    name: str = "drafter"

    @abstractmethod
    def propose(self, model: DecoderModel, cache: PagedKVCache, step: RoundInput) -> Draft: ...

    def describe(self) -> dict:
        """What stats and reports say about this drafter."""
        return {"drafter": self.name}


class ExitDrafter(Drafter):
    """Draft with layers [0, N) + the final norm and LM head; verification reuses the layer-N hidden
    states and the layer-<N cache entries the draft wrote (nothing is recomputed or copied)."""

    name = "exit"

    def __init__(self, draft_layers: int) -> None:
        self.draft_layers = draft_layers

    def describe(self) -> dict:
        return {"drafter": self.name, "draft_layers": self.draft_layers}

    def logits(self, model: DecoderModel, h: torch.Tensor, batch: AttentionBatch, cache: PagedKVCache) -> torch.Tensor:
        """Layer-N hidden states [A, 1, hidden] of a draft pass -> draft logits [A, vocab]."""
        return model.logits(h[:, -1])

    def propose(self, model: DecoderModel, cache: PagedKVCache, step: RoundInput) -> Draft:
        n, rows = self.draft_layers, len(step.seqs)
        inputs = [[t] for t in step.last]  # per row: tokens fed through layers [0, N): last, d_1, d_2, ...
        hidden: list[list[torch.Tensor]] = [[] for _ in range(rows)]  # per row: layer-N states, each [1, hidden]
        drafts: list[list[int]] = [[] for _ in range(rows)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(rows)]
        active = [b for b in range(rows) if step.gammas[b] > 0]
        while active:
            x = torch.tensor([[inputs[b][-1]] for b in active])  # [A, 1]
            batch = cache.prepare([step.seqs[b] for b in active], [1] * len(active))
            h = model.forward(x, cache, batch=batch, end=n)  # [A, 1, hidden] at layer N
            logits = self.logits(model, h, batch, cache)  # [A, vocab]
            ids, q = sample_rows(logits, [step.params[b] for b in active], [step.generators[b] for b in active])
            top = _top_prob(logits, q) if step.confidence_threshold > 0 else None
            still = []
            for i, b in enumerate(active):
                hidden[b].append(h[i])
                drafts[b].append(int(ids[i]))
                inputs[b].append(int(ids[i]))
                if q is not None:
                    probs[b].append(q[i])
                if len(drafts[b]) < step.gammas[b] and (top is None or top[i] >= step.confidence_threshold):
                    still.append(b)
            active = still
        # Every row's last input (its last draft, or `last` without drafts) through layers [0, N) as well,
        # so that verification starts at layer N everywhere.
        h = model.forward(torch.tensor([[inp[-1]] for inp in inputs]), cache, step.seqs, end=n)  # [B, 1, hidden]
        width = max(len(d) for d in drafts) + 1
        verify_in = torch.zeros(rows, width, h.shape[-1], dtype=h.dtype)  # [B, γ_max + 1, hidden], padded
        for b in range(rows):
            verify_in[b, : len(drafts[b]) + 1] = torch.cat(hidden[b] + [h[b]])
        return Draft(drafts, probs, verify_in, resume=n)


def _top_prob(logits: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    """[B]: the draft's top probability (greedy rows: of the unscaled softmax)."""
    if probs is not None:
        return probs.max(-1).values
    return torch.softmax(logits, -1).max(-1).values
