"""Prometheus metrics of the server, in the spirit of vLLM's: speculative-decoding counters (drafts,
draft tokens, accepted tokens, accepted tokens per position), latency histograms, load gauges."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 20, 60)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.drafts = Counter("selfspec_spec_decode_num_drafts", "Speculative rounds run", registry=r)
        self.draft_tokens = Counter("selfspec_spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted_tokens = Counter("selfspec_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter(
            "selfspec_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by draft position",
            ["position"],
            registry=r,
        )
        self.draft_tokens_by = Counter(
            "selfspec_spec_decode_drafter_draft_tokens", "Draft tokens proposed, by drafter", ["drafter"], registry=r
        )
        self.accepted_tokens_by = Counter(
            "selfspec_spec_decode_drafter_accepted_tokens", "Draft tokens accepted, by drafter", ["drafter"], registry=r
        )
        for position in range(8):  # the usual positions show from the start, at zero
            self.accepted_per_pos.labels(str(position))
        self.prompt_tokens = Counter("selfspec_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("selfspec_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter(
            "selfspec_request_success", "Requests finished, by reason", ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "selfspec_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "selfspec_inter_token_latency_seconds", "Time between tokens", buckets=LATENCY_BUCKETS, registry=r
        )
        self.latency = Histogram(
            "selfspec_e2e_request_latency_seconds", "Request latency", buckets=LATENCY_BUCKETS, registry=r
        )
        self.preemptions = Counter(
            "selfspec_num_preemptions", "Running requests preempted to free KV blocks (recomputed later)", registry=r
        )
        self.running = Gauge("selfspec_num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("selfspec_num_requests_waiting", "Requests queued", registry=r)
        self.blocks_used = Gauge("selfspec_kv_cache_blocks_used", "KV cache blocks in use", registry=r)
        self.blocks_free = Gauge("selfspec_kv_cache_blocks_free", "KV cache blocks free", registry=r)
        self._last_token: dict[int, float] = {}  # id(submission) -> time of its last tokens

    def observe_load(self, scheduler) -> None:
        running, waiting = scheduler.load
        self.running.set(running)
        self.waiting.set(waiting)
        self.blocks_used.set(scheduler.cache.num_used_blocks)
        self.blocks_free.set(scheduler.cache.num_free_blocks)

    def observe_tokens(self, sub, count: int, now: float) -> None:
        if count == 0:
            return
        key = id(sub)
        if key not in self._last_token:
            self.ttft.observe(now - sub.arrival)
        else:
            gap = (now - self._last_token[key]) / count  # a round emitting k tokens: k gaps of equal share
            for _ in range(count):
                self.itl.observe(gap)
        self._last_token[key] = now
        self.generation_tokens.inc(count)

    def observe_finish(self, sub) -> None:
        self._last_token.pop(id(sub), None)
        req = sub.req
        self.latency.observe(time.perf_counter() - sub.arrival)
        self.prompt_tokens.inc(len(req.prompt_ids))
        self.requests.labels(req.finish_reason or ("cancelled" if sub.cancelled else "error")).inc()
        s = req.stats.spec
        if s is not None:
            self.drafts.inc(s.rounds)
            self.draft_tokens.inc(s.drafted)
            self.accepted_tokens.inc(s.accepted)
            self.draft_tokens_by.labels(s.drafter).inc(s.drafted)
            self.accepted_tokens_by.labels(s.drafter).inc(s.accepted)
            for i, n in enumerate(s.accepted_per_position):
                if n:
                    self.accepted_per_pos.labels(str(i)).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
