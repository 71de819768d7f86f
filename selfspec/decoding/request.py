"""A request's lifecycle: its tokens, cache view, sampling state and statistics, and what each
appended token does to it (stop strings, EOS, length), plus the chunks and results handed back."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model.cache import SequenceKV
from .detokenizer import TextStream
from .round import SpecConfig
from .sampling import SamplingParams, TokenLogprob
from .stats import DecodeStats


@dataclass
class StepOutput:
    token_ids: list[int]
    texts: list[str]  # text delta per token
    logprobs: list[TokenLogprob] | None = None  # per token, when the request asked for logprobs


@dataclass
class GenerationChunk:
    token_id: int
    text: str  # text this token made visible (may be empty, e.g. mid UTF-8 character)
    finish_reason: str | None  # None while running, then "stop" or "length"
    stats: DecodeStats
    logprob: TokenLogprob | None = None  # when the request asked for logprobs


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: DecodeStats
    logprobs: list[TokenLogprob] | None = None  # per token, when the request asked for logprobs

    def to_dict(self) -> dict:
        out = {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }
        if self.logprobs is not None:
            out["logprobs"] = [{"token_id": t.token_id, "logprob": t.logprob, "top": t.top} for t in self.logprobs]
        return out


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    kv: SequenceKV
    generator: torch.Generator
    text: TextStream
    max_length: int  # prompt + output may not exceed this many tokens
    eos_token_ids: frozenset[int] = frozenset()
    spec_config: SpecConfig | None = None  # None: plain decoding
    confidence_threshold: float = 0.0  # adaptive draft stop
    policy_gamma: bool = False  # its γ is the policy's: a batched round may cap it (SpecPolicy.batch_gamma)
    prefilled: bool = False
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: DecodeStats = field(default_factory=DecodeStats)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens(self) -> list[int]:
        """Prompt and output so far: what the cache holds, then the last token (the next round's input)."""
        return self.prompt_ids + self.output_ids

    @property
    def unfilled(self) -> int:
        """Tokens still to run into the cache before decoding: all but the last, minus what it holds
        (a cached prefix, earlier prefill chunks; after a preemption, the output too)."""
        return len(self.prompt_ids) + len(self.output_ids) - 1 - self.kv.length

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def remaining(self) -> int:
        """Tokens the request may still emit."""
        return self.max_length - len(self.prompt_ids) - len(self.output_ids)

    def append(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> StepOutput:
        """Appends sampled tokens until one finishes the request; returns those kept with their text
        (and their `logprobs`, one per token of `tokens`, when given)."""
        out = StepOutput([], [], None if logprobs is None else [])
        p = self.params
        for i, token in enumerate(tokens):
            self.output_ids.append(token)
            self.stats.generated_tokens += 1
            text = self.text.push(token)
            if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids or self.text.stopped:
                self.finish_reason = "stop"
            elif len(self.output_ids) >= p.max_tokens or self.remaining <= 0:
                self.finish_reason = "length"
            if self.finished:
                text += self.text.flush()
            out.token_ids.append(token)
            out.texts.append(text)
            if logprobs is not None:
                out.logprobs.append(logprobs[i])
            if self.finished:
                break
        return out
