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
from typing import TYPE_CHECKING, Callable

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
    # True: its Draft carries hidden states and verification resumes mid-model (an early exit), so its
    # rows cannot share a pass with rows verified from layer 0 (every other drafter's).
    resumes: bool = False

    @abstractmethod
    def propose(self, model: DecoderModel, cache: PagedKVCache, step: RoundInput) -> Draft: ...

    def describe(self) -> dict:
        """What stats and reports say about this drafter."""
        return {"drafter": self.name}


class ExitDrafter(Drafter):
    """Draft with layers [0, N) + the final norm and LM head; verification reuses the layer-N hidden
    states and the layer-<N cache entries the draft wrote (nothing is recomputed or copied)."""

    name = "exit"
    resumes = True

    def __init__(self, draft_layers: int) -> None:
        self.draft_layers = draft_layers

    def describe(self) -> dict:
        return {"drafter": self.name, "draft_layers": self.draft_layers}

    def logits(self, model: DecoderModel, h: torch.Tensor, batch: AttentionBatch, cache: PagedKVCache) -> torch.Tensor:
        """Layer-N hidden states [A, 1, hidden] of a draft pass -> draft logits [A, vocab]."""
        return model.logits(h[:, -1])

    def propose(self, model: DecoderModel, cache: PagedKVCache, step: RoundInput) -> Draft:
        n, rows = self.draft_layers, len(step.seqs)
        run = autoregress(model, cache, step, n, lambda h, batch: self.logits(model, h, batch, cache))
        # Every row's last input (its last draft, or `last` without drafts) through layers [0, N) as well,
        # so that verification starts at layer N everywhere.
        last = [d[-1] if d else t for d, t in zip(run.tokens, step.last)]
        h = model.forward(torch.tensor(last, device=model.device)[:, None], cache, step.seqs, end=n)  # [B, 1, hidden]
        width = max(len(d) for d in run.tokens) + 1
        verify_in = torch.zeros(rows, width, h.shape[-1], dtype=h.dtype, device=h.device)  # [B, γ_max + 1, hidden]
        for b in range(rows):
            verify_in[b, : len(run.tokens[b]) + 1] = torch.cat(run.hidden[b] + [h[b]])
        return Draft(run.tokens, run.probs, verify_in, resume=n)


@dataclass
class Run:
    """What an autoregressive draft produced per row."""

    tokens: list[list[int]]  # d_1 .. d_γb
    probs: list[list[torch.Tensor]]  # q_i [vocab] per draft (sampled rows only)
    hidden: list[list[torch.Tensor]]  # [1, hidden] at the draft's last layer for inputs last, d_1 .. d_γb-1


def autoregress(
    model: DecoderModel,
    cache: PagedKVCache,
    step: RoundInput,
    end: int,
    logits: Callable[[torch.Tensor, AttentionBatch], torch.Tensor],
    gammas: list[int] | None = None,
) -> Run:
    """Drafts token by token with layers [0, end) of `model` on the shared cache (writing the K/V of
    the draft positions there): each pass feeds every active row its newest token, `logits(h, batch)`
    maps the layer-`end` states [A, 1, hidden] to draft logits [A, vocab], penalized (when the step's rows
    penalize) with each row's history and its drafts so far. A row stops at its γ_b (`gammas`, default
    the step's) or, with a confidence threshold, once its top draft probability falls below it."""
    gammas = step.gammas if gammas is None else gammas
    rows = len(step.seqs)
    run = Run([[] for _ in range(rows)], [[] for _ in range(rows)], [[] for _ in range(rows)])
    active = [b for b in range(rows) if gammas[b] > 0]
    while active:
        newest = [[run.tokens[b][-1] if run.tokens[b] else step.last[b]] for b in active]
        x = torch.tensor(newest, device=model.device)  # [A, 1]
        batch = cache.prepare([step.seqs[b] for b in active], [1] * len(active))
        h = model.forward(x, cache, batch=batch, end=end)  # [A, 1, hidden] at layer `end`
        lg = logits(h, batch)  # [A, vocab]
        if step.penalties is not None:  # q is processed as the target's p will be: over its own running history
            lg = step.penalties.step(lg, active, [run.tokens[b] for b in active])
        ids, q = sample_rows(lg, [step.params[b] for b in active], [step.generators[b] for b in active])
        threshold = step.confidence_threshold
        confident = (_top_prob(lg, q) >= threshold).tolist() if threshold > 0 else None  # [A] bool
        picked = ids.tolist()  # the step's one wait for the device: the next input is built from these
        still = []
        for i, b in enumerate(active):
            run.hidden[b].append(h[i])
            run.tokens[b].append(picked[i])
            if q is not None:
                run.probs[b].append(q[i])
            if len(run.tokens[b]) < gammas[b] and (confident is None or confident[i]):
                still.append(b)
        active = still
    return run


def _top_prob(logits: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    """[B]: the draft's top probability (greedy rows: of the unscaled softmax)."""
    if probs is not None:
        return probs.max(-1).values
    return torch.softmax(logits, -1).max(-1).values
