"""One decoding round over a batch of sequences sharing the paged KV cache: plain (one token) or
speculative (a drafter proposes up to γ tokens per row, one pass verifies them, the accepted prefix
stays and the rest is dropped by a length edit).

Every sequence enters a round with its cache holding all of its tokens but the last one, `last`,
at position p0 = seq.length, and leaves it the same way."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..errors import SelfspecError
from ..model.cache import PagedKVCache, SequenceKV
from ..model.decoder import DecoderModel
from .acceptance import greedy_accept, native_rejection_sample, rejection_sample
from .drafter import Drafter
from .sampling import Penalties, SamplingParams, TokenLogprob, argmax, process_rows, sample_rows, token_logprobs

MAX_SPECULATIVE_TOKENS = 32


# What drafts (decoding/drafter.py and one file per source):
# exit: the first N layers; head: the trained head at N; auto: the head where one exists at N, else the exit;
# int4 / int8: the model's own weights at 4 / 8 bits (all layers, or the first N); lookup: n-gram match
# over the prompt and output so far; hybrid: lookup where the whole n-gram recurs, the int4 self-draft elsewhere.
DRAFTERS = ("auto", "exit", "head", "int4", "int8", "lookup", "hybrid")
EXIT_DRAFTERS = ("auto", "exit", "head")  # need N below the layer count; they resume verification at N
MAX_NGRAM = 8


@dataclass(frozen=True)
class SpecConfig:
    """Draft through `drafter` (with its first `draft_layers` layers where it runs layers; None: all of
    them for int4/int8, unused by lookup); propose up to `num_speculative_tokens` (γ) per round; lookup
    matches the last `ngram` .. min(2, ngram) tokens (lookup.SHORTEST), the hybrid's lookup the last
    `ngram` only."""

    draft_layers: int | None = None
    num_speculative_tokens: int = 4
    drafter: str = "auto"
    ngram: int = 3

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter={self.drafter!r} is invalid: use one of {', '.join(DRAFTERS)}")
        n, g = self.draft_layers, self.num_speculative_tokens
        if n is None and self.drafter in EXIT_DRAFTERS:
            raise ValueError(f"drafter {self.drafter!r} needs draft_layers (the exit depth N)")
        if n is not None and (not _is_int(n) or n < 1):
            raise ValueError(f"draft_layers={n!r} is invalid: use an integer >= 1 (and below the model's layer count)")
        if not _is_int(g) or not 1 <= g <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens={g!r} is invalid: use an integer in [1, {MAX_SPECULATIVE_TOKENS}]"
            )
        if not _is_int(self.ngram) or not 1 <= self.ngram <= MAX_NGRAM:
            raise ValueError(f"ngram={self.ngram!r} is invalid: use an integer in [1, {MAX_NGRAM}]")

    def check(self, num_layers: int) -> None:
        n = self.draft_layers
        top = num_layers - 1 if self.drafter in EXIT_DRAFTERS else num_layers  # a full quantized copy may run all
        if n is not None and n > top:
            raise SelfspecError(
                f"draft_layers={n} is invalid for a {num_layers}-layer model: use 1..{top} "
                f"with drafter {self.drafter!r}"
            )


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class RoundInput:
    """Everything one round needs, one object per round (rows are sequences of a batch)."""

    seqs: list[SequenceKV]  # [B] each holding all of its tokens but `last`
    last: list[int]  # [B] the token each row feeds first
    params: list[SamplingParams]  # [B]
    generators: list[torch.Generator | None]  # [B]
    gammas: list[int] | None = None  # [B] draft tokens per row at most (0: a plain row); None: all 0
    drafter: Drafter | None = None  # None: a plain round
    confidence_threshold: float = 0.0  # > 0: a row stops drafting once its top draft probability falls below
    history: list[list[int]] | None = None  # [B] each row's tokens so far, ending with `last` (lookup, penalties)
    prompt_lens: list[int] | None = None  # [B] history's prompt tokens; the rest were generated (penalties)
    penalties: Penalties | None = None  # built from params, history, prompt_lens; stays None where none penalize

    def __post_init__(self) -> None:
        self.gammas = [0] * len(self.seqs) if self.gammas is None else list(self.gammas)
        if self.penalties is None:
            self.penalties = Penalties.of(self.params, self.history, self.prompt_lens)


@dataclass
class RoundResult:
    tokens: list[list[int]]  # per row: the tokens this round emitted
    num_accepted: list[int]  # per row: accepted drafts (speculative rounds; 0 for plain ones)
    drafted: list[int]  # per row: draft tokens (γ, or fewer: length cap, adaptive stop, plain rows)
    draft_seconds: float = 0.0  # the sequential draft steps
    verify_seconds: float = 0.0  # the rest: verification, acceptance, rollback
    logprobs: list[list[TokenLogprob] | None] | None = None  # per row asking for them: one per emitted token


def run_round(model: DecoderModel, cache: PagedKVCache, step: RoundInput) -> RoundResult:
    """A speculative round when the step has a drafter and some row may draft, else a plain one."""
    if step.drafter is None or not any(step.gammas):
        return plain_round(model, cache, step)
    return speculative_round(model, cache, step)


def plain_round(model: DecoderModel, cache: PagedKVCache, step: RoundInput) -> RoundResult:
    h = model.forward(torch.tensor(step.last, device=model.device)[:, None], cache, step.seqs)  # [B, 1, hidden]
    rows = len(step.seqs)
    if _argmax_only(step):
        ids = model.greedy(h[:, -1])  # [B]
        return RoundResult([[t] for t in ids.tolist()], [0] * rows, [0] * rows)
    logits = model.logits(h[:, -1])  # [B, vocab] raw: logprobs are taken from these
    judged = logits if step.penalties is None else step.penalties.step(logits, list(range(rows)), [[]] * rows)
    # a row of no drafts: sampled as a speculative round samples its last token (native.c on the CPU)
    no_drafts = torch.zeros(rows, 0, dtype=torch.long, device=judged.device)  # [B, 0]
    caps = torch.zeros(rows, dtype=torch.long, device=judged.device)  # [B]
    sampled = native_rejection_sample(no_drafts, caps, [[]] * rows, judged[:, None], step.params, step.generators)
    ids = sampled.output_ids[:, 0] if sampled is not None else sample_rows(judged, step.params, step.generators)[0]
    tokens = [[t] for t in ids.tolist()]  # one read from the device
    return RoundResult(tokens, [0] * rows, [0] * rows, logprobs=_logprobs(logits[:, None], tokens, step.params))


def speculative_round(model: DecoderModel, cache: PagedKVCache, step: RoundInput) -> RoundResult:
    """Draft (up to γ_b tokens per row), verify [last, d_1 .. d_γb] in one pass, keep the accepted prefix.
    Rows with γ_b = 0 are plain steps sharing the round's passes."""
    p0 = [s.length for s in step.seqs]
    start = time.perf_counter()
    draft = step.drafter.propose(model, cache, step)
    drafted = time.perf_counter()
    counts = [len(d) + 1 for d in draft.tokens]
    x = draft.hidden if draft.hidden is not None else _token_inputs(step.last, draft.tokens, model.device)
    # Verification: inputs [last, d_1 .. d_γ] at positions p0 .. p0 + γ. The logits at index i are the
    # target's distribution for position p0 + i + 1: they judge draft d_{i+1}; index γ gives the bonus.
    h = model.forward(x, cache, step.seqs, start=draft.resume, counts=counts, starts=p0)  # [B, γ_max + 1, hidden]
    if _argmax_only(step):
        target_logits = None
        tokens, accepted = greedy_accept(draft.tokens, model.greedy(h).tolist())
    else:
        target_logits = model.logits(h)  # [B, γ_max + 1, vocab] raw: logprobs are taken from these
        judged = target_logits if step.penalties is None else step.penalties.verify(target_logits, draft.tokens)
        tokens, accepted = _accept(draft.tokens, draft.probs, judged, step.params, step.generators)
    for b, seq in enumerate(step.seqs):
        cache.truncate(seq, p0[b] + accepted[b] + 1)  # rollback = a length edit
    drafted_per_row = [len(d) for d in draft.tokens]
    logprobs = None if target_logits is None else _logprobs(target_logits, tokens, step.params)
    seconds = time.perf_counter() - drafted
    return RoundResult(tokens, accepted, drafted_per_row, drafted - start, seconds, logprobs)


def _argmax_only(step: RoundInput) -> bool:
    """Every row greedy, unpenalized and without logprobs: the round needs only the target's argmax
    (DecoderModel.greedy), not its logits."""
    return step.penalties is None and all(p.greedy and p.logprobs is None for p in step.params)


def _logprobs(
    logits: torch.Tensor, tokens: list[list[int]], params: list[SamplingParams]
) -> list[list[TokenLogprob] | None] | None:
    """Raw target logits [B, W, vocab]; tokens emitted per row (token i at position i) -> per row asking
    for them, the tokens' log-probabilities; None when no row asks (nothing computed)."""
    if all(p.logprobs is None for p in params):
        return None
    return [
        None if p.logprobs is None else token_logprobs(logits[b, : len(t)], t, p.logprobs)
        for b, (t, p) in enumerate(zip(tokens, params))
    ]


def _token_inputs(last: list[int], drafts: list[list[int]], device: torch.device) -> torch.Tensor:
    """[B, γ_max + 1] token ids [last, d_1 ..] per row on `device`, padded with token 0 (built as a list:
    one copy to the device)."""
    width = max(len(d) for d in drafts) + 1
    rows = [[t, *d] + [0] * (width - len(d) - 1) for t, d in zip(last, drafts)]
    return torch.tensor(rows, dtype=torch.long, device=device)


def _padded(drafts: list[list[int]], device: torch.device, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row d_1..d_γb -> (draft ids [B, width] padded with 0; caps [B]: each row's own γ_b)."""
    caps = torch.tensor([len(d) for d in drafts], device=device)  # [B]
    padded = [d + [0] * (width - len(d)) for d in drafts]
    return torch.tensor(padded, dtype=torch.long, device=device).view(len(drafts), width), caps


def _accept(
    drafts: list[list[int]],
    probs: list[list[torch.Tensor]],
    target_logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> tuple[list[list[int]], list[int]]:
    """drafts: per row d_1..d_γb; probs: per row q_1..q_γb (empty for greedy rows); target_logits
    [B, γ_max + 1, vocab]. Rows are padded to γ_max and capped at their own γ_b. -> (tokens per row,
    accepted per row)."""
    if all(p.greedy for p in params):
        return greedy_accept(drafts, argmax(target_logits).tolist())
    rows, vocab = target_logits.shape[0], target_logits.shape[-1]
    width, dev = target_logits.shape[1] - 1, target_logits.device
    draft_ids, caps = _padded(drafts, dev, width)
    fast = native_rejection_sample(draft_ids, caps, probs, target_logits, params, generators)
    if fast is not None:
        return fast.rows()
    q = torch.zeros(rows, width, vocab, device=dev)  # [B, γ_max, vocab]; padding stays zero, so residual = p there
    for b, d in enumerate(drafts):
        for i, t in enumerate(d):
            if i < len(probs[b]):
                q[b, i] = probs[b][i]
            else:  # a greedy row drafted in an all-greedy pass: its q is the one-hot of its argmax
                q[b, i, t] = 1.0
    p = process_rows(target_logits, params)  # [B, γ_max + 1, vocab]
    return rejection_sample(draft_ids, q, p, generators, caps).rows()
