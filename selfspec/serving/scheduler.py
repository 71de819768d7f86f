"""Continuous batching: one speculative round is the scheduling unit; requests join and leave
between rounds.

Admission is by current need (the vLLM model): a request is admitted when its prompt and one round's
lookahead fit beside what the running requests need for their next round, and a request that fits is
never held behind one that does not. Blocks are taken as requests grow. When the pool runs out, the
most recently admitted request is preempted: its full blocks go to the prefix cache, the rest are
freed, and it waits at the head of the queue to be recomputed later; its output so far is kept, and
recomputation continues it exactly where it was. Prompts are prefilled in chunks under a per-iteration
token budget, between decode rounds, so running streams keep their pace while a long prompt comes in.
A bounded queue pushes back on clients beyond all that."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..decoding.engine import Engine
from ..decoding.policy import Speculation
from ..decoding.request import Request
from ..decoding.sampling import SamplingParams, TokenLogprob
from ..decoding.stats import DecodeStats
from ..errors import SelfspecError
from .blocks import BlockManager
from .prefix_cache import PrefixCache

# While requests are decoding, an iteration runs their round and then prefill chunks of at most
# PREFILL_BUDGET tokens in all (less the decode rows' tokens) and about PREFILL_SECONDS of work, so a
# stream's gap between two rounds stays near one round + PREFILL_SECONDS however long a new prompt is.
# (Measured with a 7,000-token prompt beside a stream at 2 threads: largest gap 0.37-0.48 s at 0.15 s,
# 0.50-0.73 s at 0.25 s; the prompt itself took 69-83 s, sharing each iteration with the stream.
# Sizing chunks to fill a fixed iteration time instead measured worse: decode rounds vary, and a slow
# one after a long chunk made the largest gap.) With nothing decoding, chunks of IDLE_PREFILL_SECONDS
# keep prefill efficient while a request that arrives meanwhile still gets in within about that.
PREFILL_BUDGET = 256
PREFILL_SECONDS = 0.15
IDLE_PREFILL_SECONDS = 2.0
# A prompt's first chunk, before its prefill rate is known. After a prefix-cache hit deeper than
# DEEP_PREFIX tokens, one block instead: each of its tokens attends to every cached one (64 tokens at
# depth 2,000 cost about 0.25 s here by the SDPA and linear timings, more than a chunk's budget).
FIRST_CHUNK = 64
DEEP_PREFIX = 512


class QueueFull(SelfspecError):
    """The waiting queue is at its bound: the client should retry later."""


@dataclass
class Event:
    """What one round produced for one request, handed to its `emit` callback (scheduler thread)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stats: DecodeStats | None = None  # set on the last event
    error: str | None = None
    status: int = 200  # with an error: 400 for what the request asked, 500 for a failure of ours
    logprobs: list[TokenLogprob] | None = None  # per token of token_ids, when the request asked for them


@dataclass
class Submission:
    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[Event], None]
    speculation: Speculation = "auto"
    category: str | None = None
    id: str = ""
    arrival: float = field(default_factory=time.perf_counter)
    req: Request | None = None  # created once, when the request is first considered for admission
    cancelled: bool = False
    preemptions: int = 0
    prefill_rate: float | None = None  # prompt tokens per second of its last prefill chunk


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        *,
        max_batch_size: int = 16,
        max_waiting: int = 64,
        prefix_cache_fraction: float = 0.25,
        prefill_budget: int = PREFILL_BUDGET,
        prefill_seconds: float = PREFILL_SECONDS,
        max_request_tokens: int | None = None,
        metrics=None,
    ) -> None:
        if max_batch_size < 1 or max_waiting < 0 or prefill_budget < 1:
            raise ValueError(
                f"max_batch_size={max_batch_size}, max_waiting={max_waiting}, prefill_budget={prefill_budget}: "
                "use >= 1, >= 0 and >= 1"
            )
        if max_request_tokens is not None and max_request_tokens < 2:
            raise ValueError(f"max_request_tokens={max_request_tokens}: use >= 2 (or None for no cap)")
        self.engine = engine
        self.cache = engine.cache
        self.max_batch_size = max_batch_size
        self.max_waiting = max_waiting
        self.prefill_budget = prefill_budget
        self.prefill_seconds = prefill_seconds
        self.max_request_tokens = max_request_tokens
        size = int(prefix_cache_fraction * self.cache.num_blocks)
        self.prefix = PrefixCache(self.cache, size) if prefix_cache_fraction > 0 else None
        self.blocks = BlockManager(self.cache, self.prefix)
        self.metrics = metrics
        self.waiting: deque[Submission] = deque()
        self.running: list[Submission] = []  # in admission order: the last one is preempted first
        self.preemptions = 0
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        # True when the loop runs on a thread the caller gives it (run()), so start() spawns none
        self.on_caller_thread = False

    # ---- client side (any thread) -----------------------------------------------------------------
    def submit(self, sub: Submission) -> Submission:
        """Queues a request; raises QueueFull when the queue is at its bound, SelfspecError when the
        request can never be served (its prompt exceeds the context, or it asks for more tokens than
        the per-request cap)."""
        sub.id = sub.id or f"req-{next(self._ids)}"
        total = self.engine.max_model_len
        if len(sub.prompt_ids) >= total:
            raise SelfspecError(
                f"prompt has {len(sub.prompt_ids)} tokens but the context holds {total}: shorten the prompt"
            )
        cap, asked = self.max_request_tokens, len(sub.prompt_ids) + sub.params.max_tokens
        if cap is not None and asked > cap:
            raise SelfspecError(
                f"prompt ({len(sub.prompt_ids)} tokens) + max_tokens ({sub.params.max_tokens}) = {asked} exceeds "
                f"this server's cap of {cap} tokens per request: lower max_tokens or shorten the prompt"
            )
        with self._lock:
            if len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self.waiting)} requests already waiting: retry later")
            self.waiting.append(sub)
            self._lock.notify()
        return sub

    def cancel(self, sub: Submission) -> None:
        """Marks a request cancelled (a client went away); the loop frees it before the next round."""
        with self._lock:
            sub.cancelled = True
            self._lock.notify()

    @property
    def load(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)

    # ---- the loop ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Runs the loop on a thread of its own, unless the caller runs it (see run)."""
        if self.on_caller_thread:
            return
        self._thread = threading.Thread(target=self._loop, name="selfspec-scheduler", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Runs the loop on the calling thread until stop(); set `on_caller_thread` before start() is
        called. Why a server wants this: each parallel region that torch's OpenMP runtime (libgomp) starts
        from a thread other than the process's first costs ~140 µs more here (a 1-row oneDNN linear:
        259 vs 87 µs), and a decoding step starts ~121 of them, so decoding on a spawned thread ran at 16
        tok/s where the main thread runs at 22. The serve command therefore gives the main thread to
        this loop and runs the HTTP server on another."""
        self.on_caller_thread = True
        self._loop()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        if self._thread:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self.waiting and not self.running:
                    self._lock.wait()
                if self._stop:
                    break
            try:
                self.iteration()
            except Exception as e:  # never leave clients hanging: fail what is running, keep serving
                for sub in list(self.running):
                    self._finish(sub, error=f"internal error: {e!r}", status=500)

    def iteration(self) -> None:
        """Drop cancelled requests, admit what fits, plan the iteration (preempting while the pool is
        short), then run one round for the decoding requests and prefill chunks for the others."""
        self._drop_cancelled()
        self._admit()
        plan = self._plan()
        while not self._fits(plan):
            self._preempt(self.running[-1])
            plan = self._plan()
        if self.metrics:
            self.metrics.observe_load(self)
        decoding = [s for s in self.running if s.req.prefilled]
        if decoding:
            self._decode(decoding)
        for sub in [s for s in self.running if not s.req.prefilled]:
            start = time.perf_counter()
            if self.engine.prefill(sub.req, plan[id(sub)]):
                sub.prefill_rate = plan[id(sub)] / (time.perf_counter() - start)
            if sub.req.prefilled:
                self.blocks.remember(sub.req.tokens[:-1], sub.req.kv)
        if self.prefix is not None:
            self.prefix.trim()  # blocks that finished requests released may leave it over its bound

    def _decode(self, batch: list[Submission]) -> None:
        speculate = self.engine.policy.allows_batch(len(batch))
        outputs = self.engine.step_batch([s.req for s in batch], speculate=speculate)
        now = time.perf_counter()
        for sub, out in zip(batch, outputs):
            if self.metrics:
                self.metrics.observe_tokens(sub, len(out.token_ids), now)
            req = sub.req
            stats = req.stats if req.finished else None  # the last event carries them
            sub.emit(Event(out.token_ids, "".join(out.texts), req.finish_reason, stats, logprobs=out.logprobs))
            if req.finished:
                self._finish(sub)

    # ---- admission, planning and preemption -------------------------------------------------------
    def _plan(self) -> dict[int, int]:
        """id(submission) -> positions it writes this iteration: a decoding request its input + the γ
        drafts its round takes (Engine.gammas: none in a batch the policy keeps plain, whose rows would
        otherwise hold γ + 1 of the prefill budget and of the pool each); prefilling requests, oldest
        first, chunks of what the token budget leaves after the decode rows (at least a block's worth,
        so prompts progress under any decode load)."""
        decoding = [s for s in self.running if s.req.prefilled]
        speculate = self.engine.policy.allows_batch(len(decoding))  # as _decode will ask
        gammas = self.engine.gammas([s.req for s in decoding], speculate=speculate)
        plan = {id(s): self._writes(s, g) for s, g in zip(decoding, gammas)}
        idle = not plan  # nobody is streaming: larger chunks, no token budget
        budget = max(self.prefill_budget - sum(plan.values()), self.cache.block_size)
        for sub in self.running:
            if not sub.req.prefilled:
                chunk = self._chunk(sub, IDLE_PREFILL_SECONDS if idle else self.prefill_seconds)
                plan[id(sub)] = min(sub.req.unfilled, chunk if idle else min(chunk, budget))
                budget -= plan[id(sub)]
        return plan

    def _chunk(self, sub: Submission, seconds: float) -> int:
        """Prefill tokens that fit `seconds` at the rate of this request's last chunk (a chunk costs more
        the deeper it lies: attention reads every earlier token, so the last rate is the best guess)."""
        if sub.prefill_rate is None:
            return FIRST_CHUNK if sub.req.kv.length <= DEEP_PREFIX else self.cache.block_size
        return max(int(sub.prefill_rate * seconds), self.cache.block_size)

    def _fits(self, plan: dict[int, int]) -> bool:
        """Whether the pool (after evicting unused cached prefixes, if need be) holds the planned writes."""
        need = sum(self.cache.growth(s.req.kv, s.req.kv.length, plan[id(s)]) for s in self.running)
        short = need - self.cache.num_free_blocks
        if short > 0 and self.prefix is not None:
            short -= self.prefix.evict(short)
        return short <= 0

    def _lookahead(self, sub: Submission) -> int:
        """Positions a decoding request may write in a round at most (its input + γ drafts), within its
        length: what admission reserves, since a later, smaller batch may speculate."""
        config = sub.req.spec_config
        return self._writes(sub, config.num_speculative_tokens if config else 0)

    @staticmethod
    def _writes(sub: Submission, gamma: int) -> int:
        """Positions a round of γ drafts writes for a request (its input + the drafts), within its length."""
        return min(gamma + 1, sub.req.max_length - sub.req.kv.length)

    def _reserved(self) -> int:
        """Blocks the running requests will take soon: the rest of a prompt and one round, or one round."""
        total = 0
        for sub in self.running:
            req = sub.req
            todo = self._lookahead(sub) if req.prefilled else req.unfilled + 1
            total += self.cache.growth(req.kv, req.kv.length, todo)
        return total

    def _admit(self) -> None:
        """Admits waiting requests in arrival order, skipping one that does not fit now for a later one
        that does. A request needs blocks for its tokens (minus a cached prefix) and its first round."""
        with self._lock:
            queue = list(self.waiting)
        for sub in queue:
            if len(self.running) >= self.max_batch_size:
                return
            if sub.req is None and not self._create(sub):
                continue
            tokens = sub.req.tokens[:-1]
            needed = self.cache.blocks_needed(len(tokens) + self._lookahead(sub))
            if self.blocks.allocate(sub.req.kv, tokens, needed, self._reserved()):
                self._pop(sub)
                self.running.append(sub)

    def _create(self, sub: Submission) -> bool:
        """Decides and validates a request once -> False (and a 400 event) when it is invalid."""
        try:
            sub.req = self.engine.add_request(sub.prompt_ids, sub.params, sub.speculation, category=sub.category)
        except (SelfspecError, ValueError) as e:
            self._pop(sub)
            sub.emit(Event([], "", "error", error=str(e), status=400))
            return False
        return True

    def _preempt(self, sub: Submission) -> None:
        """Frees a running request's blocks (its full ones stay findable in the prefix cache) and puts it
        back at the head of the queue; its output so far is kept and will be recomputed, not redone."""
        req = sub.req
        self.blocks.remember(req.tokens[: req.kv.length], req.kv)
        self.engine.release(req)
        req.prefilled = False
        self.running.remove(sub)
        sub.preemptions += 1
        self.preemptions += 1
        if self.metrics:
            self.metrics.preemptions.inc()
        with self._lock:
            self.waiting.appendleft(sub)

    # ---- internals --------------------------------------------------------------------------------
    def _drop_cancelled(self) -> None:
        with self._lock:
            gone = [s for s in self.waiting if s.cancelled]
            for sub in gone:
                self.waiting.remove(sub)
        for sub in gone:
            if sub.req is not None:  # a preempted request already holds no blocks
                self.engine.release(sub.req)
        for sub in [s for s in self.running if s.cancelled]:
            self._finish(sub, error="cancelled")

    def _pop(self, sub: Submission) -> None:
        with self._lock:
            self.waiting.remove(sub)

    def _finish(self, sub: Submission, error: str | None = None, status: int = 200) -> None:
        if sub in self.running:
            self.running.remove(sub)
        if sub.req is not None:
            self.engine.release(sub.req)
        if error is not None:
            sub.emit(Event([], "", "error", sub.req.stats if sub.req else None, error, status))
        if self.metrics and sub.req is not None:
            self.metrics.observe_finish(sub)
