"""Continuous batching without HTTP: batched rounds equal isolated runs (fp32 greedy), prefix caching,
admission by current need, preemption, chunked prefill, cancellation, and cache hygiene."""

import threading

import pytest

from selfspec import Engine, SamplingParams, SpecConfig
from selfspec.decoding.policy import SpecOverride
from selfspec.errors import SelfspecError
from selfspec.serving import scheduler as scheduler_module
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


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def tokens_of(events: list) -> list[int]:
    return [t for ev in events for t in ev.token_ids]


def test_preemption_keeps_outputs_identical_to_isolated_runs(tiny_checkpoint):
    """A pool far smaller than the requests' worst cases: all are admitted by current need, the pool
    runs out as they grow, the newest are preempted and recomputed, and every output (greedy, and a
    seeded sampled one) equals its isolated run."""
    engine = Engine.from_pretrained(str(tiny_checkpoint), kv_cache_tokens=160)  # 10 blocks of 16
    prompts = [engine.encode(f"question {i}: " + "why " * (3 * i), chat=False) for i in range(4)]
    params = [greedy(40), greedy(45), SamplingParams(temperature=0.9, seed=7, max_tokens=40), greedy(30)]
    specs = [None, SpecConfig(2, 3), SpecConfig(2, 2), SpecConfig(drafter="lookup", num_speculative_tokens=3)]
    expected = [engine.generate(p, pr, speculation=sp).token_ids for p, pr, sp in zip(prompts, params, specs)]
    sched = Scheduler(engine, max_batch_size=8, prefix_cache_fraction=0.3)
    events, peak = {}, 0
    subs = [
        Submission(p, pr, collector(events, i), speculation=sp)
        for i, (p, pr, sp) in enumerate(zip(*[prompts, params, specs]))
    ]
    for sub in subs:
        sched.submit(sub)
    sched.iteration()
    assert len(sched.running) == 4  # worst cases (3-4 blocks each) would have admitted two
    while sched.running or sched.waiting:
        sched.iteration()
        peak = max(peak, engine.cache.num_used_blocks)
    assert sched.preemptions > 0 and sum(s.preemptions for s in subs) == sched.preemptions
    assert peak == engine.cache.num_blocks - 1  # the pool ran full, and nothing failed for it
    for i in range(4):  # a seeded sampled row draws its own randomness only: batching does not change it
        assert tokens_of(events[i]) == expected[i], f"request {i}"
        assert events[i][-1].finish_reason == "length"
    assert engine.cache.num_used_blocks == len(sched.prefix) <= sched.prefix.max_blocks


def test_a_request_that_fits_is_not_held_behind_one_that_does_not(tiny_checkpoint):
    engine = Engine.from_pretrained(str(tiny_checkpoint), kv_cache_tokens=96)  # 6 blocks
    sched = Scheduler(engine, max_batch_size=8, prefix_cache_fraction=0)
    events = {}
    running = Submission(list(range(5, 45)), greedy(8), collector(events, "a"))  # 3 blocks with its round
    big = Submission(list(range(5, 75)), greedy(4), collector(events, "big"))  # 5 blocks: waits for "a"
    small = Submission([5, 6], greedy(4), collector(events, "small"))  # 1 block: fits beside "a"
    sched.submit(running)
    sched.iteration()
    sched.submit(big)
    sched.submit(small)
    sched.iteration()
    assert small in sched.running and big in sched.waiting
    while sched.running or sched.waiting:
        sched.iteration()
    assert [events[k][-1].finish_reason for k in ("a", "big", "small")] == ["length"] * 3
    assert engine.cache.num_used_blocks == 0


def test_chunked_prefill_lets_running_streams_keep_their_pace(tiny_checkpoint):
    engine = Engine.from_pretrained(str(tiny_checkpoint))
    long_prompt = [5 + i % 200 for i in range(300)]
    expected = engine.generate(long_prompt, greedy(6), speculation=None).token_ids
    sched = Scheduler(engine, prefix_cache_fraction=0, prefill_budget=48)
    events = {}
    stream = Submission([7, 8, 9], greedy(60), collector(events, "stream"), speculation=SpecConfig(2, 3))
    sched.submit(stream)
    sched.iteration()  # prefilled
    sched.iteration()  # its first token
    late = Submission(long_prompt, greedy(6), collector(events, "late"))
    sched.submit(late)
    chunks = 0
    while not late.req or not late.req.prefilled:
        before = len(events["stream"])
        filled = late.req.kv.length if late.req else 0
        sched.iteration()
        assert len(events["stream"]) == before + 1  # the stream got a round in every iteration
        assert late.req.kv.length - filled <= 48 - 4 + 16  # the budget left by the stream's round (γ + 1)
        chunks += 1
    assert chunks >= 299 // 48
    while sched.running:
        sched.iteration()
    assert tokens_of(events["late"]) == expected


def test_a_batch_the_policy_keeps_plain_plans_one_position_a_row(tiny_checkpoint):
    """Rows that will not draft this round (a batch above the policy's max_batch_size) hold one position
    of the prefill budget and the pool each, not γ + 1."""
    engine = Engine.from_pretrained(str(tiny_checkpoint))
    expected = engine.generate([7, 8, 9], greedy(12), speculation=None).token_ids
    sched = Scheduler(engine, prefix_cache_fraction=0)
    events = {}
    streams = [Submission([7, 8, 9], greedy(12), collector(events, i), speculation=SpecConfig(2, 8)) for i in range(2)]
    for s in streams:
        sched.submit(s)
    sched.iteration()  # prefilled
    sched.iteration()  # their first tokens (plain)
    engine.policy.max_batch_size = 2
    assert [sched._plan()[id(s)] for s in streams] == [9, 9]  # the input and 8 drafts
    engine.policy.max_batch_size = 1
    assert [sched._plan()[id(s)] for s in streams] == [1, 1]
    before = [len(tokens_of(events[i])) for i in range(2)]
    sched.iteration()
    assert [len(tokens_of(events[i])) - before[i] for i in range(2)] == [1, 1]  # plain steps, as planned
    while sched.running:
        sched.iteration()
    assert [tokens_of(events[i]) for i in range(2)] == [expected, expected]


def test_a_deep_prefix_hit_starts_with_one_block(tiny_checkpoint, monkeypatch):
    """Behind a cached prefix deeper than DEEP_PREFIX, the first chunk is one block (its tokens attend to
    the whole prefix); the output still equals an isolated run."""
    monkeypatch.setattr(scheduler_module, "DEEP_PREFIX", 32)
    engine = Engine.from_pretrained(str(tiny_checkpoint))
    shared = [5 + i % 200 for i in range(96)]
    sched = Scheduler(engine)
    events = {}
    run_all(sched, [Submission(shared + [7], greedy(2), collector(events, "first"))], events)
    prompt = shared + list(range(20, 120))
    expected = engine.generate(prompt, greedy(4), speculation=None).token_ids
    sched.submit(Submission([7, 8, 9], greedy(40), collector(events, "stream")))
    sched.iteration()
    late = Submission(prompt, greedy(4), collector(events, "late"))
    sched.submit(late)
    sched.iteration()
    assert late.req.kv.length == len(shared) + engine.cache.block_size
    run_all(sched, [], events)
    assert tokens_of(events["late"]) == expected


def test_the_loop_can_run_on_the_callers_thread(tiny_checkpoint):
    """What `selfspec serve` does (Scheduler.run says why): start() then spawns no thread, run() serves
    on the calling thread and returns once stop() is called from another."""
    engine = Engine.from_pretrained(str(tiny_checkpoint))
    expected = engine.generate([5, 6, 7], greedy(8), speculation=None).token_ids
    sched = Scheduler(engine)
    sched.on_caller_thread = True
    sched.start()
    assert sched._thread is None
    events, threads = {}, set()
    collect = collector(events, "a")

    def emit(ev) -> None:
        threads.add(threading.current_thread())
        collect(ev)
        if ev.finish_reason:
            threading.Thread(target=sched.stop).start()

    sched.submit(Submission([5, 6, 7], greedy(8), emit))
    sched.run()
    assert threads == {threading.current_thread()} and tokens_of(events["a"]) == expected


def test_requests_that_can_never_be_served_are_refused_at_submit(tiny_checkpoint):
    engine = Engine.from_pretrained(str(tiny_checkpoint), kv_cache_tokens=48)
    sched = Scheduler(engine, prefix_cache_fraction=0, max_request_tokens=30)
    with pytest.raises(SelfspecError, match="shorten the prompt"):
        sched.submit(Submission(list(range(5, 55)), greedy(4), print))
    with pytest.raises(SelfspecError, match="cap of 30 tokens per request: lower max_tokens"):
        sched.submit(Submission(list(range(5, 25)), greedy(11), print))
    events = {}
    run_all(sched, [Submission(list(range(5, 25)), greedy(10), collector(events, 0))], events)
    assert len(tokens_of(events[0])) == 10


def test_context_end_finishes_with_length(tiny_checkpoint):
    """max_tokens beyond the context is not an error: the request stops where the context ends."""
    engine = Engine.from_pretrained(str(tiny_checkpoint), kv_cache_tokens=48)
    sched = Scheduler(engine, prefix_cache_fraction=0)
    events = {}
    sub = Submission(list(range(5, 45)), SamplingParams(max_tokens=100, ignore_eos=True), collector(events, 0))
    run_all(sched, [Submission(**{**sub.__dict__, "speculation": SpecConfig(2, 8)})], events)
    assert events[0][-1].finish_reason == "length" and len(tokens_of(events[0])) == 48 - 40


def test_prefix_cache_returns_to_its_bound_when_requests_finish(tiny_checkpoint):
    engine = Engine.from_pretrained(str(tiny_checkpoint))
    sched = Scheduler(engine, prefix_cache_fraction=0.01)  # a bound of a few blocks
    events = {}
    subs = [Submission([9 + i] + list(range(5, 100)), greedy(3), collector(events, i)) for i in range(4)]
    run_all(sched, subs, events)
    assert len(sched.prefix) <= sched.prefix.max_blocks


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
