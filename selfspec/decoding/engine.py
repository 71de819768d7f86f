"""The engine and its layered API: `step` (one decoding step of one request) -> `stream_generate`
(yields a `GenerationChunk` per token) -> `generate` (the whole result); `step_batch` runs one round
for many requests (the scheduler's unit).

Cache invariant: a request's KV cache holds every token except the last one, which is the input of
the next step. Plain decoding feeds that one token; speculative decoding feeds it plus a draft."""

from __future__ import annotations

import time
from typing import Iterator, Sequence

import torch

from ..device import resolve_device
from ..errors import SelfspecError
from ..model.decoder import DecoderModel
from ..model.loader import DEFAULT_MODEL, LoadedModel, load, load_weights
from . import head as heads
from . import hybrid
from .detokenizer import TextStream
from .drafter import Drafter, ExitDrafter
from .head import DraftHead, HeadDrafter
from .hybrid import HybridDrafter
from .lookup import LookupDrafter
from .mixed import MixedDrafter
from .policy import SpecPolicy, Speculation
from .profile import Profile, find_profile
from .quantized import QuantizedDrafter, share_embeddings, shared_codes, shortlist
from .request import GenerationChunk, GenerationResult, Request, StepOutput
from .round import RoundInput, SpecConfig, run_round
from .sampling import SamplingParams, make_generator
from .stats import DecodeStats, SpecStats, snapshot

PREFILL_CHUNK = 512  # prompt tokens per prefill forward: bounds the [S, T] attention scores
DEFAULT_KV_TOKENS = 8192

Prompt = str | Sequence[dict] | Sequence[int]


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
        self.device = self.model.device
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
        self.policy = SpecPolicy(find_profile(self.model, profile), backend=self.model.kernels.backend)
        head = heads.find(self.model, draft_head)
        self.heads: dict[int, DraftHead] = {head.draft_layers: head} if head else {}
        self._drafters: dict[tuple, Drafter] = {}
        self._draft_models: dict[str, DecoderModel] = {}  # quantized copies for self-drafting, by format

    @classmethod
    def from_pretrained(
        cls,
        model: str = DEFAULT_MODEL,
        *,
        dtype: str | torch.dtype = "float32",
        weights: str = "auto",
        backend: str | None = None,
        kv_cache_tokens: int | None = None,
        num_threads: int | None = None,
        profile: Profile | str | bool | None = None,
        draft_head: DraftHead | str | bool | None = None,
        device: str | torch.device = "cpu",
    ) -> "Engine":
        """`device`: cpu or cuda (cuda:N); the weights, the KV cache and every step's tensors live there.
        Asking for cuda where torch sees no GPU raises a SelfspecError saying how to fix it."""
        device = resolve_device(device)  # before anything is loaded: a wrong device fails fast
        if num_threads is not None:
            if num_threads < 1:
                raise ValueError(f"num_threads={num_threads}: must be >= 1")
            torch.set_num_threads(num_threads)
        loaded = load(model, dtype, weights, backend, device)
        return cls(loaded, kv_cache_tokens=kv_cache_tokens, profile=profile, draft_head=draft_head)

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

    # ---- drafters ---------------------------------------------------------------------------------
    def drafter(self, config: SpecConfig) -> Drafter:
        """The drafter a configuration names (round.DRAFTERS): `head` (the trained head at its depth),
        `exit` (the plain early exit), `auto` (the head where one exists at that depth, else the exit),
        `int4`/`int8` (the model's own weights quantized), `lookup`, `hybrid` (lookup, else int4). One
        instance per configuration: requests drafting with the same one share every pass of a round."""
        config.check(self.model.num_layers)
        kind, n = config.drafter, config.draft_layers
        if kind == "auto":
            kind = "head" if n in self.heads else "exit"
        if kind == "head" and n not in self.heads:
            have = ", ".join(f"N={n}" for n in self.heads) or "none loaded"
            raise SelfspecError(
                f"drafter 'head' at draft_layers={n}: no draft head at that depth ({have}); "
                "pass --draft-head PATH or use drafter 'exit'"
            )
        key = (kind, n, config.ngram if kind in ("lookup", "hybrid") else 0)
        if key not in self._drafters:
            self._drafters[key] = self._make_drafter(kind, n, config.ngram)
        return self._drafters[key]

    def _make_drafter(self, kind: str, n: int | None, ngram: int) -> Drafter:
        if kind == "head":
            return HeadDrafter(self.heads[n])
        if kind == "exit":
            return ExitDrafter(n)
        if kind == "lookup":
            return LookupDrafter(ngram)
        if kind == "hybrid":  # its fallback is the int4 drafter itself: mixed rounds share its passes
            return HybridDrafter(ngram, self.drafter(SpecConfig(n, 1, hybrid.FALLBACK)))
        return QuantizedDrafter(self.draft_model(kind), n)

    def preload(self) -> None:
        """Loads the quantized copies the policy's profile may draft with (a hybrid: hybrid.FALLBACK), so
        that no request pays for loading one (~1 s) inside its own latency."""
        profile = self.policy.profile
        used = {b.drafter for b in profile.buckets} if profile is not None else set()
        used |= {hybrid.FALLBACK} if "hybrid" in used else set()
        for weights in ("int4", "int8"):
            if weights in used:
                self.draft_model(weights)

    def draft_model(self, weights: str) -> DecoderModel:
        """The model's own weights in format `weights` (int4: a 4-bit GGUF's own codes), loaded once."""
        if weights not in self._draft_models:
            head = shortlist(self.model.head_weight)  # over the target's float head (the model's own where None)
            given = shared_codes(self.model) if weights == "int4" else None  # the target's codes, not a copy
            draft = load_weights(
                self.checkpoint_dir, self.model.dtype, weights, device=self.device, head=head, given=given
            )
            if draft.kernels.weights != weights:
                raise SelfspecError(f"drafter {weights!r} is unavailable here: {'; '.join(draft.kernels.reasons)}")
            self._draft_models[weights] = share_embeddings(draft, self.model)
        return self._draft_models[weights]

    # ---- the step API -----------------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        speculation: Speculation = "auto",
        *,
        category: str | None = None,
    ) -> Request:
        decision = self.policy.resolve(
            speculation,
            num_layers=self.model.num_layers,
            prompt_tokens=len(prompt_ids),
            params=params,
            category=category,
        )
        config = decision.config
        drafter = self.drafter(config) if config is not None else None
        if not prompt_ids:
            raise SelfspecError("empty prompt: it must hold at least one token")
        vocab = self.model.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise SelfspecError(f"prompt token ids must lie in [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise SelfspecError(
                f"prompt has {len(prompt_ids)} tokens but the context holds {self.max_model_len}: shorten the prompt"
            )
        spec_stats = None
        if config is not None:
            spec_stats = SpecStats(
                drafter.describe().get("draft_layers"), config.num_speculative_tokens, drafter=drafter.name
            )
        return Request(
            prompt_ids=list(prompt_ids),
            params=params,
            kv=self.cache.allocate(),
            generator=make_generator(params.seed, self.device),
            text=TextStream(self.tokenizer, prompt_ids, params.stop),
            max_length=min(self.max_model_len, len(prompt_ids) + params.max_tokens),
            eos_token_ids=self.eos_token_ids,
            spec_config=config,
            confidence_threshold=decision.confidence_threshold,
            policy_gamma=decision.policy_gamma,
            stats=DecodeStats(
                prompt_tokens=len(prompt_ids),
                spec=spec_stats,
                spec_policy=decision.reason,
                weights=self.model.kernels.weights,
                backend=self.model.kernels.backend,
                ops=self.model.ops.name,
            ),
        )

    def step(self, req: Request) -> StepOutput:
        """One decoding step: a speculative round when the request asks for one, else one plain token.
        The first step prefills; it is always plain, which gives the first token at the lowest latency
        and measures the full-step cost that the draft cost ratio c is taken against."""
        return self.step_batch([req])[0]

    @torch.inference_mode()
    def step_batch(self, reqs: list[Request], *, speculate: bool = True) -> list[StepOutput]:
        """One round for several requests at once (continuous batching's unit). Requests drafting with
        the same drafter share every pass; plain rows (first steps, speculation off, or
        `speculate=False`) ride along with 0 drafts. Rows of different drafters that verify from layer
        0 (int4, int8, lookup, hybrid) draft apart and verify in one pass (MixedDrafter); an early
        exit's rows, which resume mid-model, run as a group of their own."""
        for req in reqs:
            if req.finished:
                raise SelfspecError("request already finished")
            if not req.prefilled:
                self.prefill(req)
        groups: dict[Drafter | None, list[tuple[int, int]]] = {}  # drafter -> [(request index, γ_b)]
        for i, (req, gamma) in enumerate(zip(reqs, self.gammas(reqs, speculate=speculate))):
            groups.setdefault(self.drafter(req.spec_config) if gamma else None, []).append((i, gamma))
        if None in groups and len(groups) > 1:  # plain rows join a speculating group's passes
            plain = groups.pop(None)
            groups[next(iter(groups))] += plain
        layer0 = [d for d in groups if d is not None and not d.resumes]
        if len(layer0) > 1:  # their rows share one verification pass
            rows = [(i, g, k) for k, d in enumerate(layer0) for i, g in groups.pop(d)]
            groups[MixedDrafter(layer0, [k for _, _, k in rows])] = [(i, g) for i, g, _ in rows]
        outputs: list[StepOutput | None] = [None] * len(reqs)
        for drafter, rows in groups.items():
            group = [reqs[i] for i, _ in rows]
            for i, out in zip((i for i, _ in rows), self._round(group, drafter, [g for _, g in rows])):
                outputs[i] = out
        return outputs

    def gammas(self, reqs: list[Request], *, speculate: bool = True) -> list[int]:
        """Each request's γ in a step_batch round of `reqs` (0: a plain row: its first step, speculation
        off, `speculate=False`, or one token left), capped by the policy's γ for a batch that size. The
        scheduler plans each row's cache writes (γ + 1) from the same numbers."""
        drafting = [speculate and r.spec_config is not None and r.stats.steps > 0 and r.remaining > 1 for r in reqs]
        cap = self.policy.batch_gamma(sum(drafting))  # None alone, or where calibration measured no batch
        gammas = []
        for req, drafts in zip(reqs, drafting):
            gamma = min(req.spec_config.num_speculative_tokens, req.remaining - 1) if drafts else 0
            if cap is not None and req.policy_gamma:
                gamma = min(gamma, cap)
            gammas.append(gamma)
        return gammas

    def _round(self, reqs: list[Request], drafter: Drafter | None, gammas: list[int]) -> list[StepOutput]:
        step = RoundInput(
            seqs=[r.kv for r in reqs],
            last=[r.last_token for r in reqs],
            params=[r.params for r in reqs],
            generators=[r.generator for r in reqs],
            gammas=gammas,
            drafter=drafter,
            confidence_threshold=max(r.confidence_threshold for r in reqs),
            history=[r.tokens for r in reqs],
            prompt_lens=[len(r.prompt_ids) for r in reqs],
        )
        start = time.perf_counter()
        result = run_round(self.model, self.cache, step)
        elapsed = time.perf_counter() - start
        outputs = []
        for row, req in enumerate(reqs):
            outputs.append(req.append(result.tokens[row], result.logprobs[row] if result.logprobs else None))
            req.stats.record_step(result, row, elapsed, alone=drafter is None)
        return outputs

    def release(self, req: Request) -> None:
        self.cache.free(req.kv)

    # ---- generation -------------------------------------------------------------------------------
    def stream_generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        speculation: Speculation = "auto",
        chat: bool = True,
        category: str | None = None,
    ) -> Iterator[GenerationChunk]:
        params = params or SamplingParams()
        req = self.add_request(self.encode(prompt, chat=chat), params, speculation, category=category)
        try:
            while not req.finished:
                out = self.step(req)
                for i, (token, text) in enumerate(zip(out.token_ids, out.texts)):
                    last = i == len(out.token_ids) - 1
                    reason = req.finish_reason if last else None
                    logprob = out.logprobs[i] if out.logprobs is not None else None
                    yield GenerationChunk(token, text, reason, snapshot(req.stats), logprob)
        finally:
            self.release(req)

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        speculation: Speculation = "auto",
        chat: bool = True,
        category: str | None = None,
    ) -> GenerationResult:
        text, ids, reason, stats, logprobs = [], [], "length", DecodeStats(), []
        for chunk in self.stream_generate(prompt, params, speculation=speculation, chat=chat, category=category):
            text.append(chunk.text)
            ids.append(chunk.token_id)
            logprobs.append(chunk.logprob)
            reason, stats = chunk.finish_reason or reason, chunk.stats
        asked = params is not None and params.logprobs is not None
        return GenerationResult("".join(text), ids, reason, stats, logprobs if asked else None)

    # ---- pieces the scheduler drives --------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, req: Request, max_tokens: int | None = None) -> int:
        """Runs the request's tokens (all but the last, minus what its cache already holds: a cached
        prefix, earlier chunks) into the cache, at most `max_tokens` of them -> tokens run. After a
        preemption the tokens include its output so far, which is recomputed, not changed."""
        end = req.kv.length + (req.unfilled if max_tokens is None else min(max_tokens, req.unfilled))
        todo = req.tokens[req.kv.length : end]
        start = time.perf_counter()
        self.model.prefill(self.cache, req.kv, todo, PREFILL_CHUNK)
        req.stats.prefill_seconds += time.perf_counter() - start
        req.prefilled = req.unfilled == 0
        return len(todo)
