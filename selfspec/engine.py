"""The engine and its layered API: `step` (one decoding step of one request) -> `stream_generate`
(yields a `GenerationChunk` per token) -> `generate` (the whole result).

Cache invariant: a request's KV cache holds every token except the last one, which is the input of
the next step. Plain decoding feeds that one token; speculative decoding will feed it plus a draft."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Iterator, Sequence

import torch

from .detokenizer import TextStream
from .errors import SelfspecError
from .kv_cache import SequenceKV
from .loader import DEFAULT_MODEL, LoadedModel, load
from .sampling import SamplingParams, make_generator, next_token

PREFILL_CHUNK = 512  # prompt tokens per prefill forward: bounds the [S, T] attention scores
DEFAULT_KV_TOKENS = 8192

Prompt = str | Sequence[dict] | Sequence[int]


@dataclass
class DecodeStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0  # decoding steps (forwards of the full model after prefill)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # wall time inside decoding steps
    time_to_first_token: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tokens_per_second"] = self.tokens_per_second
        d["prompt_tokens_per_second"] = self.prompt_tokens_per_second
        return d


@dataclass
class GenerationChunk:
    token_id: int
    text: str  # text this token made visible (may be empty, e.g. mid UTF-8 character)
    finish_reason: str | None  # None while running, then "stop" or "length"
    stats: DecodeStats


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: DecodeStats

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    kv: SequenceKV
    generator: torch.Generator
    text: TextStream
    max_length: int  # prompt + output may not exceed this many tokens
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: DecodeStats = field(default_factory=DecodeStats)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]


@dataclass
class StepOutput:
    token_ids: list[int]
    texts: list[str]  # text delta per token


class Engine:
    def __init__(self, loaded: LoadedModel, *, kv_cache_tokens: int | None = None, block_size: int = 16) -> None:
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.name = loaded.name
        self.checkpoint_dir = loaded.checkpoint_dir
        config = self.model.config
        tokens = kv_cache_tokens or min(config.max_position_embeddings, DEFAULT_KV_TOKENS)
        if tokens < 1:
            raise ValueError(f"kv_cache_tokens={kv_cache_tokens}: must be >= 1")
        self.cache = self.model.new_cache(tokens, block_size)
        self.max_model_len = min(config.max_position_embeddings, self.cache.capacity_tokens)
        eos = set(config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)

    @classmethod
    def from_pretrained(
        cls,
        model: str = DEFAULT_MODEL,
        *,
        dtype: str | torch.dtype = "float32",
        kv_cache_tokens: int | None = None,
        num_threads: int | None = None,
    ) -> "Engine":
        if num_threads is not None:
            if num_threads < 1:
                raise ValueError(f"num_threads={num_threads}: must be >= 1")
            torch.set_num_threads(num_threads)
        return cls(load(model, dtype), kv_cache_tokens=kv_cache_tokens)

    # ---- prompts ----------------------------------------------------------------------------------
    def encode(self, prompt: Prompt, *, chat: bool = True) -> list[int]:
        """A string (chat-templated as one user turn unless chat=False), a list of chat messages, or
        token ids."""
        if isinstance(prompt, str):
            if not chat:
                return self.tokenizer(prompt).input_ids
            prompt = [{"role": "user", "content": prompt}]
        prompt = list(prompt)
        if not prompt:
            raise SelfspecError("empty prompt: give a string, chat messages or token ids")
        if all(isinstance(t, int) for t in prompt):
            return prompt
        if not getattr(self.tokenizer, "chat_template", None):
            raise SelfspecError(f"model {self.name!r} has no chat template: pass raw text (--raw / chat=False)")
        text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    # ---- the step API -----------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        if not prompt_ids:
            raise SelfspecError("empty prompt: it must hold at least one token")
        vocab = self.model.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise SelfspecError(f"prompt token ids must lie in [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise SelfspecError(
                f"prompt has {len(prompt_ids)} tokens but the context holds {self.max_model_len}: shorten the prompt"
            )
        return Request(
            prompt_ids=list(prompt_ids),
            params=params,
            kv=self.cache.allocate(),
            generator=make_generator(params.seed),
            text=TextStream(self.tokenizer, prompt_ids, params.stop),
            max_length=min(self.max_model_len, len(prompt_ids) + params.max_tokens),
            stats=DecodeStats(prompt_tokens=len(prompt_ids)),
        )

    @torch.inference_mode()
    def step(self, req: Request) -> StepOutput:
        """One decoding step: feeds the last token, samples the next. The first step prefills."""
        if req.finished:
            raise SelfspecError("request already finished")
        if req.kv.length == 0 and len(req.prompt_ids) > 1:
            self._prefill(req)
        start = time.perf_counter()
        logits = self._forward(req, [req.last_token])[:, -1]  # [1, vocab]
        token = int(next_token(logits, req.params, req.generator)[0])
        out = self._append(req, [token])
        elapsed = time.perf_counter() - start
        req.stats.decode_seconds += elapsed
        if req.stats.steps == 0:
            req.stats.time_to_first_token = req.stats.prefill_seconds + elapsed
        req.stats.steps += 1
        return out

    def release(self, req: Request) -> None:
        self.cache.free(req.kv)

    # ---- generation -------------------------------------------------------------------------------
    def stream_generate(
        self, prompt: Prompt, params: SamplingParams | None = None, *, chat: bool = True
    ) -> Iterator[GenerationChunk]:
        req = self.add_request(self.encode(prompt, chat=chat), params or SamplingParams())
        try:
            while not req.finished:
                out = self.step(req)
                for i, (token, text) in enumerate(zip(out.token_ids, out.texts)):
                    last = i == len(out.token_ids) - 1
                    reason = req.finish_reason if last else None
                    yield GenerationChunk(token, text, reason, replace(req.stats))
        finally:
            self.release(req)

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, chat: bool = True) -> GenerationResult:
        text, ids, reason, stats = [], [], "length", DecodeStats()
        for chunk in self.stream_generate(prompt, params, chat=chat):
            text.append(chunk.text)
            ids.append(chunk.token_id)
            reason, stats = chunk.finish_reason or reason, chunk.stats
        return GenerationResult("".join(text), ids, reason, stats)

    # ---- internals --------------------------------------------------------------------------------
    def _prefill(self, req: Request) -> None:
        start = time.perf_counter()
        ids = req.prompt_ids[:-1]
        for i in range(0, len(ids), PREFILL_CHUNK):
            self._forward(req, ids[i : i + PREFILL_CHUNK], logits=False)
        req.stats.prefill_seconds = time.perf_counter() - start

    def _forward(self, req: Request, tokens: list[int], *, logits: bool = True) -> torch.Tensor:
        """Runs all layers over `tokens` appended to the request's cache -> logits [1, S, vocab]."""
        batch = self.cache.prepare([req.kv], [len(tokens)])
        h = self.model.embed(torch.tensor([tokens]))
        h = self.model.run_layers(h, 0, self.model.num_layers, batch, self.cache)
        return self.model.logits(h[:, -1:]) if logits else h

    def _append(self, req: Request, tokens: list[int]) -> StepOutput:
        """Appends sampled tokens until one finishes the request; returns those kept with their text."""
        out = StepOutput([], [])
        p = req.params
        for token in tokens:
            req.output_ids.append(token)
            req.stats.generated_tokens += 1
            text = req.text.push(token)
            if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids or req.text.stopped:
                req.finish_reason = "stop"
            elif len(req.output_ids) >= p.max_tokens or len(req.prompt_ids) + len(req.output_ids) >= req.max_length:
                req.finish_reason = "length"
            if req.finished:
                text += req.text.flush()
            out.token_ids.append(token)
            out.texts.append(text)
            if req.finished:
                break
        return out
