"""Sampling parameters and the logits -> probabilities -> token path shared by plain and speculative
decoding (the acceptance rule needs target and draft processed identically)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} is invalid: use a number >= 0 (0 means greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} is invalid: use an integer >= 0 (0 turns top-k off)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} is invalid: use a number in (0, 1] (1 turns top-p off)")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed={self.seed!r} is invalid: use an integer >= 0, or leave it unset")
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., vocab] -> probabilities [..., vocab] in float32 after temperature, top-k, top-p.
    Greedy parameters give the one-hot distribution of the argmax."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p  # [..., vocab] probability mass ranked above each token
        sorted_p = sorted_p.masked_fill(mass_before >= params.top_p, 0.0)  # the top token always survives
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
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
        return logits.argmax(-1), None
    probs = process_rows(logits, params)
    return inverse_cdf(probs, uniforms(len(generators), 1, generators)[:, 0]), probs


def process_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [B, ..., vocab] with one SamplingParams per row -> probabilities of the same shape."""
    if all(p == params[0] for p in params):
        return process_logits(logits, params[0])
    return torch.stack([process_logits(logits[b], p) for b, p in enumerate(params)])


def uniforms(batch: int, n: int, generators: torch.Generator | Sequence[torch.Generator | None] | None) -> torch.Tensor:
    """[batch, n] uniform in [0, 1): from one generator per row, or from a single shared one."""
    if generators is None or isinstance(generators, torch.Generator):
        return torch.rand(batch, n, generator=generators)
    return torch.stack([torch.rand(n, generator=g) for g in generators])


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """weights [B, vocab] >= 0 (unnormalized), u [B] in [0, 1) -> one sampled index per row. Scaling u
    by the total keeps it strictly below the last cumulative value, so a zero-weight token is never hit."""
    cdf = weights.cumsum(-1)  # [B, vocab]
    target = (u * cdf[:, -1])[:, None]  # [B, 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=weights.shape[-1] - 1)
