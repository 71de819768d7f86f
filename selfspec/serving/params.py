"""A request body -> the decoding settings of each of its choices. Every check names the body field a
client has to change."""

from __future__ import annotations

import re
from dataclasses import replace

from ..decoding.sampling import MAX_LOGPROBS, SamplingParams
from .protocol import MAX_COMPLETION_LOGPROBS, ApiError, ChatBody, CompletionBody, _Common


def choices(body: _Common, max_n: int) -> int:
    n = 1 if body.n is None else body.n
    if not 1 <= n <= max_n:
        raise ApiError(400, f"n={n} is invalid: use 1..{max_n}", "n")
    return n


def logprobs(body: _Common) -> int | None:
    """How many alternatives per token the body asks for (0: the chosen token's logprob only), or None."""
    if isinstance(body, CompletionBody):
        k = body.logprobs
        if k is not None and not 0 <= k <= MAX_COMPLETION_LOGPROBS:
            raise ApiError(400, f"logprobs={k} is invalid: use 0..{MAX_COMPLETION_LOGPROBS}", "logprobs")
        if k is not None and body.echo:
            raise ApiError(400, "logprobs with echo is not supported: prompt logprobs are not computed", "echo")
        return k
    assert isinstance(body, ChatBody)
    k = body.top_logprobs
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise ApiError(400, f"top_logprobs={k} is invalid: use 0..{MAX_LOGPROBS}", "top_logprobs")
    if k is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    return (k or 0) if body.logprobs else None


def logit_bias(body: _Common, vocab_size: int) -> dict[int, float]:
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        token = int(key) if re.fullmatch(r"\d{1,10}", key) else None
        if token is None or token >= vocab_size:
            raise ApiError(400, f"logit_bias key {key!r} is not a token id in [0, {vocab_size})", "logit_bias")
        bias[token] = value
    return bias


def sampling_params(body: _Common, *, chat: bool, vocab_size: int, max_n: int) -> list[SamplingParams]:
    """One SamplingParams per choice; with a seed, choice i samples with seed + i (so choices differ
    and the request stays reproducible)."""
    n = choices(body, max_n)
    max_tokens = body.max_tokens
    if isinstance(body, ChatBody) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    try:
        first = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            seed=body.seed,
            max_tokens=(512 if chat else 16) if max_tokens is None else max_tokens,
            stop=tuple(s for s in stop if s),  # an empty stop string stops nothing: "" and [""] mean no stop
            ignore_eos=body.ignore_eos,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=logit_bias(body, vocab_size),
            logprobs=logprobs(body),
        )
    except ValueError as e:
        raise ApiError(400, str(e), _field(str(e), chat)) from None
    if first.seed is None:
        return [first] * n
    return [first] + [replace(first, seed=(first.seed + i) % 2**64) for i in range(1, n)]


def _field(message: str, chat: bool) -> str:
    # SamplingParams names its field first ("top_p=...", "logit_bias entry ..."); the body uses the
    # same names, except chat's alternatives count
    name = re.match(r"\w+", message).group()
    return "top_logprobs" if chat and name == "logprobs" else name
