"""Sampling parameters and the logits -> probabilities -> token path shared by plain and speculative
decoding (the acceptance rule needs target and draft processed identically): penalties and logit bias
(`Penalties`), then temperature, top-k and top-p (`process_logits`); and the target's log-probabilities
of emitted tokens (`token_logprobs`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..kernels.native import argmax


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target model's distribution (the raw logits'
    log-softmax, so neither speculation nor sampling settings change it) and the `top` most likely
    tokens at its position, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # None = fresh randomness per request
    max_tokens: int = 256
    stop: tuple[str, ...] = ()  # generation ends before the first occurrence of any of these strings
    stop_token_ids: tuple[int, ...] = ()  # extra end-of-sequence tokens
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    # OpenAI's penalties, over the tokens generated so far (not the prompt): presence_penalty is
    # subtracted once from the logit of every token generated at least once, frequency_penalty once per
    # occurrence. repetition_penalty (transformers / vLLM), over prompt and generated tokens: the logit
    # of every token seen there is divided by it where positive, multiplied by it where not. Then
    # logit_bias is added. 0 / 0 / 1 / (): off. All of it precedes temperature, top-k and top-p.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit); a dict is accepted
    logprobs: int | None = None  # None: off; k >= 0: each token's logprob and the k most likely alternatives

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((t, b) for t, b in bias)))
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} is invalid: use a number >= 0 (0 means greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} is invalid: use an integer >= 0 (0 turns top-k off)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} is invalid: use a number in (0, 1] (1 turns top-p off)")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed={self.seed!r} is invalid: use an integer in [0, 2**64), or leave it unset")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} is invalid: use an integer >= 1")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop={s!r} is invalid: use non-empty strings as stop sequences")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids entry {t!r} is invalid: use token ids >= 0")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r} is invalid: use True or False")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2 <= v <= 2:
                raise ValueError(f"{name}={v!r} is invalid: use a number in [-2, 2] (0 turns it off)")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10:
            raise ValueError(
                f"repetition_penalty={self.repetition_penalty!r} is invalid: use a number in (0, 10] (1 turns it off)"
            )
        for t, b in self.logit_bias:
            if not _is_int(t) or t < 0 or not _is_number(b) or not -100 <= b <= 100:
                raise ValueError(
                    f"logit_bias entry {t!r}: {b!r} is invalid: use token ids >= 0 and biases in [-100, 100]"
                )
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(
                f"logprobs={self.logprobs!r} is invalid: use an integer in [0, {MAX_LOGPROBS}], or leave it unset"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether a penalty or a logit bias changes the logits (rounds skip all of it otherwise)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or self.logit_bias)


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., vocab] -> probabilities [..., vocab] in float32 after temperature, top-k, top-p.
    Greedy parameters give the one-hot distribution of the argmax."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = _scale(logits, params.temperature)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p  # [..., vocab] probability mass ranked above each token
        drop = mass_before >= params.top_p  # [..., vocab]
        drop[..., 0] = False  # the top token always survives, even a top_p that float32 rounds to 0
        # tokens tied with the least likely one kept stay too, as native.c's cut keeps them: which of equal
        # probabilities a sort puts first must not decide (bfloat16 logits tie often)
        drop &= sorted_p < sorted_p.masked_fill(drop, math.inf).amin(-1, keepdim=True)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


FLOAT32_TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32


def _scale(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [..., vocab] / temperature. A temperature so small that this overflows (or that float32
    rounds to 0) would make softmax NaN (inf - inf, 0 / 0): there the limit is taken instead, the max
    subtracted first, so that the top token(s) scale to 0 and the rest to large negatives or -inf —
    greedy up to exact ties. Ordinary temperatures keep the plain division, bit for bit."""
    scaled = logits / temperature
    fine = torch.isfinite(scaled.amax(-1, keepdim=True))  # [..., 1]
    if fine.all():
        return scaled
    limit = (logits - logits.amax(-1, keepdim=True)) / max(temperature, FLOAT32_TINY)
    return torch.where(fine, scaled, limit)  # per row, so a row's result never depends on its batch


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own random stream on `device` (the model's: its draws then need no copy). A seed gives
    the same tokens on every run on that device type; CPU and CUDA streams differ."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()  # nondeterministic
    else:
        g.manual_seed(seed)
    return g


def sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, vocab], one SamplingParams and generator per row -> (token ids [B], probabilities
    [B, vocab] or None when every row is greedy). Greedy rows get the one-hot of their argmax."""
    if all(p.greedy for p in params):
        return argmax(logits), None
    probs = process_rows(logits, params)
    return inverse_cdf(probs, uniforms(len(generators), 1, generators, probs.device)[:, 0]), probs


def process_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [B, ..., vocab] with one SamplingParams per row -> probabilities of the same shape."""
    if all(p == params[0] for p in params):
        return process_logits(logits, params[0])
    return torch.stack([process_logits(logits[b], p) for b, p in enumerate(params)])


def uniforms(
    batch: int,
    n: int,
    generators: torch.Generator | Sequence[torch.Generator | None] | None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """[batch, n] uniform in [0, 1) on `device`: from one generator per row, or from a single shared one
    (None: torch's default generator of `device`). Each number is drawn on its generator's device, so a
    seeded stream does not depend on where its consumer runs, then moved to `device` if it differs."""
    if generators is None or isinstance(generators, torch.Generator):
        return _draw((batch, n), generators, device)
    return torch.stack([_draw((n,), g, device) for g in generators])


def _draw(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device | str) -> torch.Tensor:
    where = torch.device(device) if generator is None else generator.device
    return torch.rand(shape, generator=generator, device=where).to(device)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """weights [B, vocab] >= 0 (unnormalized), u [B] in [0, 1) -> one sampled index per row. Scaling u
    by the total keeps it strictly below the last cumulative value, so a zero-weight token is never hit."""
    cdf = weights.cumsum(-1)  # [B, vocab]
    target = (u * cdf[:, -1])[:, None]  # [B, 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=weights.shape[-1] - 1)


# ---- penalties and logit bias -------------------------------------------------------------------------


class Penalties:
    """The penalties and logit biases of one round's rows (SamplingParams.penalized), applied to raw
    logits before `process_logits`, by plain steps, draft steps and verification alike.

    Each row's history (prompt + generated tokens, ending with the round's first input) is counted
    once per round into [vocab] tables; tokens past the history (drafts) are added per position: in
    plain decoding, a draft d_i is a generated token of every position after it. Order, as in vLLM:
    repetition, then frequency and presence, then logit_bias last (so that -100 stays a ban and +100
    a force whatever the penalties did)."""

    def __init__(self, params: list[SamplingParams], history: list[list[int]], prompt_lens: list[int] | None) -> None:
        self.index = {b: k for k, b in enumerate(b for b, p in enumerate(params) if p.penalized)}  # batch row -> k
        self.params = [params[b] for b in self.index]
        self.history = [history[b] for b in self.index]
        # Where each history's generated tokens begin (without prompt_lens, only repetition is in use).
        self.starts = [len(h) if prompt_lens is None else prompt_lens[b] for b, h in zip(self.index, self.history)]
        self.vocab = 0  # the tables are built at the first call, for the logits' vocabulary

    @classmethod
    def of(
        cls, params: list[SamplingParams], history: list[list[int]] | None, prompt_lens: list[int] | None
    ) -> Penalties | None:
        """The round's penalties; None when no row uses any (the common path does nothing more)."""
        if not any(p.penalized for p in params):
            return None
        if history is None:
            raise ValueError("penalties and logit_bias need each row's token history (RoundInput.history)")
        if prompt_lens is None and any(p.presence_penalty or p.frequency_penalty for p in params):
            raise ValueError("presence and frequency penalties need each row's prompt length (RoundInput.prompt_lens)")
        return cls(params, history, prompt_lens)

    def step(self, logits: torch.Tensor, rows: list[int], extra: list[list[int]]) -> torch.Tensor:
        """logits [R, vocab] of batch rows `rows`, each penalized as if its history went on with
        extra[j] (a draft step: the drafts so far; a plain step: nothing)."""
        entries = [(j, 0, t) for j, ts in enumerate(extra) for t in ts]
        return self._apply(logits[:, None], rows, entries)[:, 0]

    def verify(self, logits: torch.Tensor, drafts: list[list[int]]) -> torch.Tensor:
        """Verification logits [B, γ_max + 1, vocab] of every batch row: position i penalized with the
        history + d_1 .. d_i, as plain decoding would have it there."""
        entries = [(b, i + 1, t) for b, ds in enumerate(drafts) for i, t in enumerate(ds)]
        return self._apply(logits, list(range(logits.shape[0])), entries, cumulative=True)

    def _apply(
        self, logits: torch.Tensor, rows: list[int], entries: list[tuple[int, int, int]], cumulative: bool = False
    ) -> torch.Tensor:
        """logits [R, W, vocab]; entries (j, position, token): tokens generated past the history of
        rows[j], counted from that position on where `cumulative`, else at that position only."""
        picked = [j for j, b in enumerate(rows) if b in self.index]
        if not picked:
            return logits
        dev = logits.device
        self._build(logits.shape[-1], dev)
        where = {j: n for n, j in enumerate(picked)}
        delta = torch.zeros(len(picked), logits.shape[1], self.vocab, device=dev)  # [P, W, vocab] past the history
        entries = [(where[j], pos, t) for j, pos, t in entries if j in where]
        if entries:
            index = tuple(torch.tensor(entries, device=dev).T)
            delta.index_put_(index, torch.ones(len(entries), device=dev), accumulate=True)
            if cumulative:
                delta = delta.cumsum(1)
        ks = torch.tensor([self.index[rows[j]] for j in picked], device=dev)  # [P] table rows
        out = logits.float().clone()  # [R, W, vocab]; rows without penalties stay as they are
        out[picked] = self._penalize(out[picked], ks, delta)
        return out

    def _penalize(self, logits: torch.Tensor, ks: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """logits [P, W, vocab] float32 of table rows ks [P]; delta [P, W, vocab] occurrences past the history."""
        generated = self.generated[ks, None] + delta  # [P, W, vocab] occurrences among generated tokens
        seen = self.seen[ks, None] | (delta > 0)  # [P, W, vocab] in the prompt or generated
        rep = self.repetition[ks]  # [P, 1, 1]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - self.frequency[ks] * generated - self.presence[ks] * (generated > 0)
        return logits + self.bias[ks, None]

    def _build(self, vocab: int, device: torch.device) -> None:
        """The per-row tables on the logits' `device`, once per round: generated-token counts, seen masks,
        dense biases [P, vocab] and the penalty values [P, 1, 1]."""
        if self.vocab == vocab:
            return
        rows = len(self.params)
        self.vocab = vocab
        self.generated = torch.zeros(rows, vocab, device=device)  # [P, vocab]
        self.seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)  # [P, vocab]
        self.bias = torch.zeros(rows, vocab, device=device)  # [P, vocab]
        for k, (p, history, start) in enumerate(zip(self.params, self.history, self.starts)):
            ids = torch.tensor(history, dtype=torch.long, device=device)  # [T]
            self.generated[k] = torch.bincount(ids[start:], minlength=vocab)[:vocab]
            self.seen[k, ids] = True
            bias = [(t, b) for t, b in p.logit_bias if t < vocab]  # ids past the vocabulary bias nothing
            if bias:
                where = torch.tensor([t for t, _ in bias], device=device)
                self.bias[k, where] = torch.tensor([float(b) for _, b in bias], device=device)
        for name in ("presence", "frequency", "repetition"):
            values = [getattr(p, f"{name}_penalty") for p in self.params]
            setattr(self, name, torch.tensor(values, dtype=torch.float32, device=device)[:, None, None])


# ---- log-probabilities ----------------------------------------------------------------------------------


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """Raw logits [n, vocab] at the positions of n emitted tokens -> each token's log-probability (float32
    log-softmax, before penalties and sampling settings) and the k most likely tokens there."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()  # [n]
    k = min(k, logp.shape[-1])
    if k == 0:
        return [TokenLogprob(t, c) for t, c in zip(tokens, chosen)]
    top = logp.topk(k, dim=-1)  # values / indices [n, k], most likely first
    pairs = [tuple(zip(ids, vals)) for ids, vals in zip(top.indices.tolist(), top.values.tolist())]
    return [TokenLogprob(t, c, alt) for t, c, alt in zip(tokens, chosen, pairs)]
