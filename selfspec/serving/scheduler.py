"""Continuous batching: one speculative round is the scheduling unit; requests join and leave
between rounds. Admission is by free KV blocks, counting every running request's worst case, so a
running request never runs out of cache and none is ever evicted; what does not fit waits, and a
bounded queue pushes back on clients beyond that. Full prompt blocks go into a prefix cache."""

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
from ..decoding.sampling import SamplingParams
from ..decoding.stats import DecodeStats
from ..errors import SelfspecError
from .blocks import BlockManager
from .prefix_cache import PrefixCache


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


@dataclass
class Submission:
    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[Event], None]
    speculation: Speculation = "auto"
    category: str | None = None
    id: str = ""
    arrival: float = field(default_factory=time.perf_counter)
    req: Request | None = None  # created once, when the request first reaches the head of the queue
    cancelled: bool = False
    blocks_needed: int = 0  # its worst case: prompt + max_tokens + one round's lookahead


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        *,
        max_batch_size: int = 16,
        max_waiting: int = 64,
        prefix_cache_fraction: float = 0.25,
        metrics=None,
    ) -> None:
        if max_batch_size < 1 or max_waiting < 0:
            raise ValueError(f"max_batch_size={max_batch_size}, max_waiting={max_waiting}: use >= 1 and >= 0")
        self.engine = engine
        self.cache = engine.cache
        self.max_batch_size = max_batch_size
        self.max_waiting = max_waiting
        size = int(prefix_cache_fraction * self.cache.num_blocks)
        self.prefix = PrefixCache(self.cache, size) if prefix_cache_fraction > 0 else None
        self.blocks = BlockManager(self.cache, self.prefix)
        self.metrics = metrics
        self.waiting: deque[Submission] = deque()
        self.running: list[Submission] = []
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False

    # ---- client side (any thread) -----------------------------------------------------------------
    def submit(self, sub: Submission) -> Submission:
        """Queues a request; raises QueueFull when the queue is at its bound, SelfspecError when the
        request can never fit the cache."""
        sub.id = sub.id or f"req-{next(self._ids)}"
        total = self.engine.max_model_len
        if len(sub.prompt_ids) >= total:
            raise SelfspecError(
                f"prompt has {len(sub.prompt_ids)} tokens but the context holds {total}: shorten the prompt"
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
        self._thread = threading.Thread(target=self._loop, name="selfspec-scheduler", daemon=True)
        self._thread.start()

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
        """Drop cancelled requests, admit what fits, run one round for everything running."""
        self._drop_cancelled()
        self._admit()
        if self.metrics:
            self.metrics.observe_load(self)
        if not self.running:
            return
        batch = list(self.running)
        speculate = self.engine.policy.allows_batch(len(batch))
        outputs = self.engine.step_batch([s.req for s in batch], speculate=speculate)
        now = time.perf_counter()
        for sub, out in zip(batch, outputs):
            if self.metrics:
                self.metrics.observe_tokens(sub, len(out.token_ids), now)
            if sub.req.finished:
                sub.emit(Event(out.token_ids, "".join(out.texts), sub.req.finish_reason, sub.req.stats))
                self._finish(sub)
            else:
                sub.emit(Event(out.token_ids, "".join(out.texts)))

    # ---- internals --------------------------------------------------------------------------------
    def _drop_cancelled(self) -> None:
        with self._lock:
            for sub in [s for s in self.waiting if s.cancelled]:
                self.waiting.remove(sub)
        for sub in [s for s in self.running if s.cancelled]:
            self._finish(sub, error="cancelled")

    def _reserved(self) -> int:
        """Blocks running requests may still take before they finish."""
        return sum(max(0, s.blocks_needed - len(s.req.kv.block_table)) for s in self.running)

    def _admit(self) -> None:
        while len(self.running) < self.max_batch_size:
            with self._lock:
                if not self.waiting:
                    return
                sub = self.waiting[0]
            if sub.req is None:  # first time at the head of the queue: decide and validate once
                try:
                    sub.req = self.engine.add_request(
                        sub.prompt_ids, sub.params, sub.speculation, category=sub.category
                    )
                except (SelfspecError, ValueError) as e:
                    self._pop(sub)
                    sub.emit(Event([], "", "error", error=str(e), status=400))
                    continue
                config = sub.req.spec_config
                lookahead = (config.num_speculative_tokens if config else 0) + 1
                sub.blocks_needed = self.cache.blocks_needed(sub.req.max_length + lookahead)
            if not self.blocks.allocate(sub.req.kv, sub.prompt_ids[:-1], sub.blocks_needed, self._reserved()):
                if self.running:
                    return  # wait for running requests to finish
                self._pop(sub)  # nothing will ever free more: this request cannot fit at all
                have = self.cache.num_blocks - 1
                error = f"request needs {sub.blocks_needed} KV blocks, the cache has {have}: lower max_tokens"
                sub.emit(Event([], "", "error", error=error, status=400))
                continue
            self._pop(sub)
            self.engine.prefill(sub.req)
            self.blocks.remember(sub.prompt_ids[:-1], sub.req.kv)
            self.running.append(sub)

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
