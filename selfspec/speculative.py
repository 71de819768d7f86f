"""One decoding round over a batch of sequences sharing the paged KV cache: plain (one token) or
self-speculative (draft with layers [0, N), verify with layers [N, L), keep the accepted prefix).

Every sequence enters a round with its cache holding all of its tokens but the last one, `last`,
at position p0 = seq.length, and leaves it the same way."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from .acceptance import AcceptanceResult, greedy_accept, rejection_sample
from .attention import AttentionBatch
from .errors import SelfspecError
from .kv_cache import PagedKVCache, SequenceKV
from .model import DecoderModel
from .sampling import SamplingParams, process_rows, sample_rows

MAX_SPECULATIVE_TOKENS = 32

# Draft logits from layer-N hidden states [A, 1, hidden] of a pass (its batch, the cache) -> [A, vocab].
DraftLogits = Callable[[torch.Tensor, AttentionBatch, PagedKVCache], torch.Tensor]


@dataclass(frozen=True)
class SpecConfig:
    """Draft with the first `draft_layers` layers; propose `num_speculative_tokens` (γ) per round."""

    draft_layers: int
    num_speculative_tokens: int = 4

    def __post_init__(self) -> None:
        n, g = self.draft_layers, self.num_speculative_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"draft_layers={n!r} is invalid: use an integer >= 1 (and below the model's layer count)")
        if not isinstance(g, int) or isinstance(g, bool) or not 1 <= g <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens={g!r} is invalid: use an integer in [1, {MAX_SPECULATIVE_TOKENS}]"
            )

    def check(self, num_layers: int) -> None:
        if self.draft_layers >= num_layers:
            raise SelfspecError(
                f"draft_layers={self.draft_layers} is invalid for a {num_layers}-layer model: use 1..{num_layers - 1}"
            )


@dataclass
class RoundResult:
    tokens: list[list[int]]  # per row: the tokens this round emitted
    num_accepted: list[int]  # per row: accepted drafts (speculative rounds; 0 for plain ones)
    drafted: list[int]  # per row: draft tokens (γ, or fewer: length cap, adaptive stop, plain rows)
    draft_seconds: float = 0.0  # the γ sequential draft steps
    verify_seconds: float = 0.0  # the rest: last draft pass, verification, acceptance, rollback


def _run(model: DecoderModel, cache: PagedKVCache, seqs, hidden, start: int, end: int, counts=None, starts=None):
    """hidden [B, S, hidden] through layers [start, end); row b holds counts[b] real tokens (default S)."""
    batch = cache.prepare(seqs, counts or [hidden.shape[1]] * len(seqs), starts)
    return model.run_layers(hidden, start, end, batch, cache)


def plain_round(
    model: DecoderModel,
    cache: PagedKVCache,
    seqs: list[SequenceKV],
    last: list[int],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> RoundResult:
    h = _run(model, cache, seqs, model.embed(torch.tensor(last)[:, None]), 0, model.num_layers)  # [B, 1, hidden]
    ids, _ = sample_rows(model.logits(h[:, -1]), params, generators)  # [B]
    return RoundResult([[int(t)] for t in ids], [0] * len(seqs), [0] * len(seqs))


def speculative_round(
    model: DecoderModel,
    cache: PagedKVCache,
    seqs: list[SequenceKV],
    last: list[int],
    spec: SpecConfig,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    confidence_threshold: float = 0.0,
    gammas: list[int] | None = None,
    draft_logits: DraftLogits | None = None,
) -> RoundResult:
    """`gammas` caps each row's drafts (default γ for all; 0 makes the row a plain step that shares
    the round's passes). `confidence_threshold` > 0 ends a row's draft once its top probability falls
    below it (the adaptive draft stop); the round verifies the drafts each row has. `draft_logits`
    maps layer-N hidden states to draft logits (a trained draft head's `draft`); default: final norm +
    LM head."""
    draft_logits = draft_logits or (lambda h, batch, cache: model.logits(h[:, -1]))
    n, rows = spec.draft_layers, len(seqs)
    caps = list(gammas) if gammas is not None else [spec.num_speculative_tokens] * rows
    p0 = [s.length for s in seqs]
    start = time.perf_counter()
    inputs = [[t] for t in last]  # per row: tokens fed through layers [0, N), i.e. last, d_1, d_2, ...
    hidden = [[] for _ in range(rows)]  # per row: their layer-N hidden states, each [1, hidden]
    drafts = [[] for _ in range(rows)]  # per row: draft ids d_1 ..
    probs: list[list[torch.Tensor]] = [[] for _ in range(rows)]  # per row: q_i [vocab] when sampled
    active = [b for b in range(rows) if caps[b] > 0]
    while active:
        x = torch.tensor([[inputs[b][-1]] for b in active])  # [A, 1]
        batch = cache.prepare([seqs[b] for b in active], [1] * len(active))
        h = model.run_layers(model.embed(x), 0, n, batch, cache)  # [A, 1, hidden] at layer N
        logits = draft_logits(h, batch, cache)  # [A, vocab]
        ids, q = sample_rows(logits, [params[b] for b in active], [generators[b] for b in active])
        top = _top_prob(logits, q) if confidence_threshold > 0 else None
        still = []
        for i, b in enumerate(active):
            hidden[b].append(h[i])
            drafts[b].append(int(ids[i]))
            inputs[b].append(int(ids[i]))
            if q is not None:
                probs[b].append(q[i])
            if len(drafts[b]) < caps[b] and (top is None or top[i] >= confidence_threshold):
                still.append(b)
        active = still
    drafted = time.perf_counter()
    # Every row's last input (its last draft, or `last` without drafts) through layers [0, N) as well,
    # so that verification starts at layer N everywhere.
    h = _run(model, cache, seqs, model.embed(torch.tensor([[inp[-1]] for inp in inputs])), 0, n)  # [B, 1, hidden]
    counts = [len(d) + 1 for d in drafts]
    verify_in = torch.zeros(rows, max(counts), h.shape[-1], dtype=h.dtype)  # [B, γ_max + 1, hidden], padded
    for b in range(rows):
        verify_in[b, : counts[b]] = torch.cat(hidden[b] + [h[b]])
    # Verification: inputs [last, d_1 .. d_γ] at positions p0 .. p0 + γ. The logits at index i are the
    # target's distribution for position p0 + i + 1: they judge draft d_{i+1}; index γ gives the bonus.
    h = _run(model, cache, seqs, verify_in, n, model.num_layers, counts=counts, starts=p0)  # [B, γ_max + 1, hidden]
    target_logits = model.logits(h)  # [B, γ_max + 1, vocab]
    result = _accept(drafts, probs, target_logits, params, generators)
    for b, seq in enumerate(seqs):
        cache.truncate(seq, p0[b] + int(result.num_accepted[b]) + 1)  # rollback = a length edit
    tokens = [result.tokens(b) for b in range(rows)]
    drafted_per_row = [len(d) for d in drafts]
    return RoundResult(tokens, result.num_accepted.tolist(), drafted_per_row, drafted - start, time.perf_counter() - drafted)


def _top_prob(logits: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    """[B]: the draft's top probability (greedy rows: of the unscaled softmax)."""
    if probs is not None:
        return probs.max(-1).values
    return torch.softmax(logits, -1).max(-1).values


def _accept(
    drafts: list[list[int]],
    probs: list[list[torch.Tensor]],
    target_logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> AcceptanceResult:
    """drafts: per row d_1..d_γb; probs: per row q_1..q_γb (empty for greedy rows); target_logits
    [B, γ_max + 1, vocab]. Rows are padded to γ_max and capped at their own γ_b."""
    rows, vocab = target_logits.shape[0], target_logits.shape[-1]
    width = target_logits.shape[1] - 1
    caps = torch.tensor([len(d) for d in drafts])  # [B]
    draft_ids = torch.zeros(rows, width, dtype=torch.long)  # [B, γ_max], padded with token 0
    for b, d in enumerate(drafts):
        draft_ids[b, : len(d)] = torch.tensor(d, dtype=torch.long)
    if all(p.greedy for p in params):
        return greedy_accept(draft_ids, target_logits.argmax(-1), caps)
    q = torch.zeros(rows, width, vocab)  # [B, γ_max, vocab]; padding stays zero, so residual = p there
    for b, d in enumerate(drafts):
        for i, t in enumerate(d):
            if i < len(probs[b]):
                q[b, i] = probs[b][i]
            else:  # a greedy row drafted in an all-greedy pass: its q is the one-hot of its argmax
                q[b, i, t] = 1.0
    p = process_rows(target_logits, params)  # [B, γ_max + 1, vocab]
    return rejection_sample(draft_ids, q, p, generators, caps)
