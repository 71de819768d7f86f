"""Continuous batching without HTTP: batched rounds equal isolated runs (fp32 greedy), prefix caching,
admission by free blocks, cancellation, and cache hygiene."""

import pytest

from selfspec import Engine, SamplingParams, SpecConfig
from selfspec.decoding.policy import SpecOverride
from selfspec.serving.scheduler import QueueFull, Scheduler, Submission

SYSTEM = "You are a terse assistant. Answer in one short sentence, no more than twelve words. " * 3


def run_all(scheduler: Scheduler, subs: list[Submission], events: dict) -> None:
    for s in subs:
        scheduler.submit(s)
    for _ in range(10_000):
        if not scheduler.running and not scheduler.waiting:
            return
        scheduler.iteration()
    raise AssertionError("the scheduler did not drain")


def collector(events: dict, key):
    events[key] = []
    return lambda ev: events[key].append(ev)


def test_batched_requests_equal_isolated_runs(tiny_checkpoint):
    engine = Engine.from_pretrained(str(tiny_checkpoint))
    prompts = [
        engine.encode([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        for q in ("hi", "what is 2+2?", "name a colour", "tell me a joke please", "bye", "why?")
    ]
    specs = [
        None,
        SpecConfig(2, 3),
        SpecOverride(draft_layers=1, num_speculative_tokens=2),
        SpecConfig(3, 1),
        None,
        SpecConfig(2, 5),
    ]
    params = [SamplingParams(temperature=0, max_tokens=10 + 3 * i, ignore_eos=True) for i in range(6)]
    expected = [engine.generate(p, pr, speculation=None).token_ids for p, pr in zip(prompts, params)]
    sched = Scheduler(engine, max_batch_size=4)  # 6 requests: two join later, between rounds
    events = {}
    subs = [
        Submission(p, pr, collector(events, i), speculation=sp)
        for i, (p, pr, sp) in enumerate(zip(prompts, params, specs))
    ]
    # a sampled request rides along
    subs.append(
        Submission(
            prompts[0],
            SamplingParams(temperature=0.8, seed=1, max_tokens=12),
            collector(events, "s"),
            speculation=SpecConfig(2, 2),
        )
    )
    run_all(sched, subs, events)
    for i in range(6):
        tokens = [t for ev in events[i] for t in ev.token_ids]
        assert tokens == expected[i], f"request {i}"
        assert events[i][-1].finish_reason == "length" and events[i][-1].stats.generated_tokens == len(expected[i])
    assert len([t for ev in events["s"] for t in ev.token_ids]) == 12
    assert sched.prefix.hits > 0  # the shared system prompt was prefilled once
    assert engine.cache.num_used_blocks == len(sched.prefix)  # only the prefix cache holds blocks now
    sched.prefix.clear()
    assert engine.cache.num_used_blocks == 0


def test_admission_waits_for_blocks_and_never_overcommits(tiny_checkpoint):
    engine = Engine.from_pretrained(str(tiny_checkpoint), kv_cache_tokens=96)  # 6 blocks of 16
    sched = Scheduler(engine, max_batch_size=8, prefix_cache_fraction=0)
    events = {}
    subs = [
        Submission(
            engine.encode(f"q{i}", chat=False),
            SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
            collector(events, i),
        )
        for i in range(5)
    ]
    for s in subs:
        sched.submit(s)
    sched.iteration()
    assert len(sched.running) == 2 and len(sched.waiting) == 3  # 3 blocks each in the worst case
    peak = 0
    while sched.running or sched.waiting:
        sched.iteration()
        peak = max(peak, engine.cache.num_used_blocks)
    assert peak <= 6  # the cache's capacity: two requests of 3 worst-case blocks each
    assert all(events[i][-1].finish_reason == "length" for i in range(5))
    assert engine.cache.num_used_blocks == 0


def test_request_too_big_for_the_cache_gets_an_error(tiny_checkpoint):
    engine = Engine.from_pretrained(str(tiny_checkpoint), kv_cache_tokens=48)
    sched = Scheduler(engine, prefix_cache_fraction=0)
    events = {}
    run_all(
        sched,
        [
            Submission(
                list(range(5, 45)), SamplingParams(max_tokens=100), collector(events, 0), speculation=SpecConfig(2, 8)
            )
        ],
        events,
    )
    assert events[0][-1].error and "KV blocks" in events[0][-1].error and events[0][-1].status == 400


def test_bounded_queue_and_cancellation(tiny_checkpoint):
    engine = Engine.from_pretrained(str(tiny_checkpoint))
    sched = Scheduler(engine, max_batch_size=1, max_waiting=2, prefix_cache_fraction=0)
    events = {}
    subs = [
        Submission(engine.encode("x", chat=False), SamplingParams(max_tokens=50, ignore_eos=True), collector(events, i))
        for i in range(3)
    ]
    sched.submit(subs[0])
    sched.submit(subs[1])
    with pytest.raises(QueueFull, match="retry later"):
        sched.submit(subs[2])
    sched.iteration()
    assert len(sched.running) == 1
    sched.cancel(subs[0])
    sched.cancel(subs[1])
    sched.iteration()
    assert not sched.running and not sched.waiting and engine.cache.num_used_blocks == 0
