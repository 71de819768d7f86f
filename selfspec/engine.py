"""The engine and its layered API: `step` (one decoding step of one request) -> `stream_generate`
(yields a `GenerationChunk` per token) -> `generate` (the whole result).

Cache invariant: a request's KV cache holds every token except the last one, which is the input of
the next step. Plain decoding feeds that one token; speculative decoding will feed it plus a draft."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Iterator, Sequence

import torch

from .batch import prefill as prefill_tokens
from . import draft_head as draft_heads
from .detokenizer import TextStream
from .draft_head import DraftHead
from .errors import SelfspecError
from .kv_cache import SequenceKV
from .loader import DEFAULT_MODEL, LoadedModel, load
from .sampling import SamplingParams, make_generator
from .policy import PolicyDecision, SpecOverride, SpecPolicy
from .profile import Profile, default_profile_path
from .speculative import RoundResult, SpecConfig, plain_round, speculative_round

PREFILL_CHUNK = 512  # prompt tokens per prefill forward: bounds the [S, T] attention scores
DEFAULT_KV_TOKENS = 8192

Prompt = str | Sequence[dict] | Sequence[int]


@dataclass
class SpecStats:
    """Speculation counted per round: a round drafts γ tokens and emits accepted + 1."""

    draft_layers: int
    num_speculative_tokens: int
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)  # [γ] rounds that drafted position i
    accepted_per_position: list[int] = field(default_factory=list)  # [γ] rounds that kept draft i
    draft_seconds: float = 0.0  # the sequential draft steps
    verify_seconds: float = 0.0  # verification, acceptance and rollback
    full_steps: int = 0  # plain one-token steps of the same request (the first step is one)
    full_step_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.drafted_per_position = self.drafted_per_position or [0] * self.num_speculative_tokens
        self.accepted_per_position = self.accepted_per_position or [0] * self.num_speculative_tokens

    def record(self, result: RoundResult, row: int = 0) -> None:
        accepted, gamma = result.num_accepted[row], result.drafted[row]
        self.rounds += 1
        self.drafted += gamma
        self.accepted += accepted
        for i in range(gamma):  # a round near the length limit drafts fewer than γ
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < accepted
        self.draft_seconds += result.draft_seconds
        self.verify_seconds += result.verify_seconds

    def merge(self, other: "SpecStats") -> "SpecStats":
        """Sum of two requests' counters (same γ), for aggregated reports."""
        out = SpecStats(self.draft_layers, self.num_speculative_tokens)
        for name in ("rounds", "drafted", "accepted", "draft_seconds", "verify_seconds", "full_steps", "full_step_seconds"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.drafted_per_position = [a + b for a, b in zip(self.drafted_per_position, other.drafted_per_position)]
        out.accepted_per_position = [a + b for a, b in zip(self.accepted_per_position, other.accepted_per_position)]
        return out

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_tokens_per_round(self) -> float:
        return 1 + self.accepted / self.rounds if self.rounds else 0.0

    @property
    def draft_cost_ratio(self) -> float:
        """c: wall time of one draft step / one full plain step, both measured in this run."""
        if not (self.drafted and self.full_steps):
            return 0.0
        return (self.draft_seconds / self.drafted) / (self.full_step_seconds / self.full_steps)

    @property
    def verify_cost_ratio(self) -> float:
        """Wall time of one verification (layers [N, L) over γ + 1 tokens, acceptance, rollback) / one
        full plain step. Self-speculation verifies with only L - N layers, so this is often below 1."""
        if not (self.rounds and self.full_steps):
            return 0.0
        return (self.verify_seconds / self.rounds) / (self.full_step_seconds / self.full_steps)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["verify_cost_ratio"] = self.verify_cost_ratio
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_tokens_per_round"] = self.mean_tokens_per_round
        d["draft_cost_ratio"] = self.draft_cost_ratio
        d["acceptance_per_position"] = [
            a / n if n else 0.0 for a, n in zip(self.accepted_per_position, self.drafted_per_position)
        ]
        return d


@dataclass
class DecodeStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0  # decoding steps (forwards of the full model after prefill)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # wall time inside decoding steps
    time_to_first_token: float = 0.0
    spec: SpecStats | None = None  # None for plain decoding
    spec_policy: str = ""  # why this request speculates (or not), as decided by the policy

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["spec"] = self.spec.to_dict() if self.spec else None
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
    spec: SpecConfig | None = None
    confidence_threshold: float = 0.0  # adaptive draft stop
    prefilled: bool = False
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


def _snapshot(stats: DecodeStats) -> DecodeStats:
    if stats.spec is None:
        return replace(stats)
    spec = replace(
        stats.spec,
        drafted_per_position=list(stats.spec.drafted_per_position),
        accepted_per_position=list(stats.spec.accepted_per_position),
    )
    return replace(stats, spec=spec)


Speculation = SpecConfig | SpecOverride | str | bool | None  # "auto" (the policy), None/False (off), a config


class Engine:
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        kv_cache_tokens: int | None = None,
        block_size: int = 16,
        profile: Profile | str | bool | None = None,
        draft_head: DraftHead | str | bool | None = None,
    ) -> None:
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
        self.policy = SpecPolicy(self._profile(profile))
        head = self._draft_head(draft_head)
        self.draft_heads: dict[int, DraftHead] = {head.draft_layers: head} if head else {}

    def _draft_head(self, head: DraftHead | str | bool | None) -> DraftHead | None:
        """An explicit draft head (object or path), none (False), else the shipped one for this model."""
        if head is False or isinstance(head, DraftHead):
            return head or None
        path = head if head is not None else draft_heads.default_path(self.model)
        return draft_heads.load(path, self.model) if path else None

    def _profile(self, profile: Profile | str | bool | None) -> Profile | None:
        """An explicit profile (object or path), none at all (False), else the shipped one for this
        model and dtype, if any."""
        if profile is False:
            return None
        if isinstance(profile, Profile):
            found = profile
        elif profile is not None:
            found = Profile.load(profile)
        else:
            dtype = str(self.model.dtype).replace("torch.", "")
            path = default_profile_path(self.model.fingerprint, dtype)
            found = Profile.load(path) if path.is_file() else None
        if found is not None and found.fingerprint != self.model.fingerprint:
            raise SelfspecError(
                f"profile for model {found.model!r} (fingerprint {found.fingerprint}) does not match this model "
                f"({self.model.fingerprint}): calibrate this model with selfspec calibrate"
            )
        return found

    @classmethod
    def from_pretrained(
        cls,
        model: str = DEFAULT_MODEL,
        *,
        dtype: str | torch.dtype = "float32",
        kv_cache_tokens: int | None = None,
        num_threads: int | None = None,
        profile: Profile | str | bool | None = None,
        draft_head: DraftHead | str | bool | None = None,
    ) -> "Engine":
        if num_threads is not None:
            if num_threads < 1:
                raise ValueError(f"num_threads={num_threads}: must be >= 1")
            torch.set_num_threads(num_threads)
        return cls(load(model, dtype), kv_cache_tokens=kv_cache_tokens, profile=profile, draft_head=draft_head)

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
    def decide(
        self, prompt_tokens: int, params: SamplingParams, spec: Speculation = "auto", *, category: str | None = None
    ) -> PolicyDecision:
        """Whether and how a request speculates: `spec` is "auto" (the policy decides from the profile),
        None / False (plain), a SpecConfig (exactly that), or a SpecOverride (the request's say)."""
        if spec is None or spec is False:
            return PolicyDecision(None, "off: disabled by the request")
        if isinstance(spec, SpecConfig):
            spec.check(self.model.num_layers)
            return PolicyDecision(spec, f"on: requested (N={spec.draft_layers}, gamma={spec.num_speculative_tokens})")
        if spec is True:
            spec = SpecOverride(enabled=True)
        elif spec == "auto":
            spec = SpecOverride()
        elif not isinstance(spec, SpecOverride):
            raise ValueError(f"spec={spec!r} is invalid: use 'auto', None, a SpecConfig or a SpecOverride")
        decision = self.policy.decide(
            num_layers=self.model.num_layers,
            prompt_tokens=prompt_tokens,
            temperature=params.temperature,
            max_tokens=params.max_tokens,
            category=category,
            override=spec,
        )
        if decision.spec is not None:
            decision.spec.check(self.model.num_layers)
        return decision

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, spec: Speculation = "auto", *, category: str | None = None
    ) -> Request:
        decision = self.decide(len(prompt_ids), params, spec, category=category)
        spec = decision.spec
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
            spec=spec,
            confidence_threshold=decision.confidence_threshold,
            stats=DecodeStats(
                prompt_tokens=len(prompt_ids),
                spec=SpecStats(spec.draft_layers, spec.num_speculative_tokens) if spec else None,
                spec_policy=decision.reason,
            ),
        )

    def step(self, req: Request) -> StepOutput:
        """One decoding step: a speculative round when the request asks for one, else one plain token.
        The first step prefills; it is always plain, which gives the first token at the lowest latency
        and measures the full-step cost that the draft cost ratio c is taken against."""
        return self.step_batch([req])[0]

    @torch.inference_mode()
    def step_batch(self, reqs: list[Request], *, speculate: bool = True) -> list[StepOutput]:
        """One round for several requests at once (continuous batching's unit). Requests speculating
        with the same draft depth share every pass; plain rows (first steps, speculation off, or
        `speculate=False`) ride along with 0 drafts. Different depths run as separate groups."""
        for req in reqs:
            if req.finished:
                raise SelfspecError("request already finished")
            if not req.prefilled:
                self.prefill(req)
        groups: dict[int | None, list[tuple[int, int]]] = {}  # draft depth -> [(request index, γ_b)]
        for i, req in enumerate(reqs):
            remaining = req.max_length - len(req.prompt_ids) - len(req.output_ids)  # tokens it may still emit
            if speculate and req.spec is not None and req.stats.steps > 0 and remaining > 1:
                groups.setdefault(req.spec.draft_layers, []).append((i, min(req.spec.num_speculative_tokens, remaining - 1)))
            else:
                groups.setdefault(None, [])
                groups[None].append((i, 0))
        if None in groups and len(groups) > 1:  # plain rows join a speculating group's passes
            plain = groups.pop(None)
            groups[next(iter(groups))] += plain
        outputs: list[StepOutput | None] = [None] * len(reqs)
        for depth, rows in groups.items():
            self._round([reqs[i] for i, _ in rows], depth, [g for _, g in rows], outputs, [i for i, _ in rows])
        return outputs

    def _round(self, reqs: list[Request], depth: int | None, gammas: list[int], outputs: list, slots: list[int]) -> None:
        seqs, last = [r.kv for r in reqs], [r.last_token for r in reqs]
        params, gens = [r.params for r in reqs], [r.generator for r in reqs]
        start = time.perf_counter()
        if depth is None:
            result = plain_round(self.model, self.cache, seqs, last, params, gens)
        else:
            spec = SpecConfig(depth, max(gammas))
            threshold = max(r.confidence_threshold for r in reqs)
            head = self.draft_heads.get(depth)
            result = speculative_round(
                self.model, self.cache, seqs, last, spec, params, gens, threshold, gammas, head.draft if head else None
            )
        elapsed = time.perf_counter() - start
        for row, (req, slot) in enumerate(zip(reqs, slots)):
            outputs[slot] = self.append(req, result.tokens[row])
            stats = req.stats
            if stats.spec is not None:
                if result.drafted[row] == 0:
                    if depth is None:  # a plain step measured alone: the reference for c
                        stats.spec.full_steps += 1
                        stats.spec.full_step_seconds += elapsed
                else:
                    stats.spec.record(result, row)
            stats.decode_seconds += elapsed
            if stats.steps == 0:
                stats.time_to_first_token = stats.prefill_seconds + elapsed
            stats.steps += 1

    def release(self, req: Request) -> None:
        self.cache.free(req.kv)

    # ---- generation -------------------------------------------------------------------------------
    def stream_generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        spec: Speculation = "auto",
        chat: bool = True,
        category: str | None = None,
    ) -> Iterator[GenerationChunk]:
        req = self.add_request(self.encode(prompt, chat=chat), params or SamplingParams(), spec, category=category)
        try:
            while not req.finished:
                out = self.step(req)
                for i, (token, text) in enumerate(zip(out.token_ids, out.texts)):
                    last = i == len(out.token_ids) - 1
                    reason = req.finish_reason if last else None
                    yield GenerationChunk(token, text, reason, _snapshot(req.stats))
        finally:
            self.release(req)

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        spec: Speculation = "auto",
        chat: bool = True,
        category: str | None = None,
    ) -> GenerationResult:
        text, ids, reason, stats = [], [], "length", DecodeStats()
        for chunk in self.stream_generate(prompt, params, spec=spec, chat=chat, category=category):
            text.append(chunk.text)
            ids.append(chunk.token_id)
            reason, stats = chunk.finish_reason or reason, chunk.stats
        return GenerationResult("".join(text), ids, reason, stats)

    # ---- pieces the scheduler drives ----------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, req: Request) -> None:
        """Runs the prompt (all but its last token, minus any prefix already cached) into the cache."""
        start = time.perf_counter()
        prefill_tokens(self.model, self.cache, req.kv, req.prompt_ids[req.kv.length : -1], PREFILL_CHUNK)
        req.stats.prefill_seconds = time.perf_counter() - start
        req.prefilled = True

    def append(self, req: Request, tokens: list[int]) -> StepOutput:
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
