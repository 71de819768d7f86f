"""Engine behaviour on a tiny random model with the default tokenizer: layered API, finish reasons,
seeds, limits and cache hygiene."""

import pytest

from selfspec import Engine, SamplingParams, SelfspecError


def test_stream_chunks_add_up_to_generate(tiny_engine):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    chunks = list(tiny_engine.stream_generate("hello there", params))
    result = tiny_engine.generate("hello there", params)
    assert [c.token_id for c in chunks] == result.token_ids
    assert "".join(c.text for c in chunks) == result.text
    assert [c.finish_reason for c in chunks] == [None] * 19 + ["length"]
    assert result.stats.generated_tokens == 20 and result.stats.steps == 20
    assert result.stats.prompt_tokens == len(tiny_engine.encode("hello there"))
    assert result.stats.tokens_per_second > 0
    assert chunks[0].stats.generated_tokens == 1  # running stats are snapshots


def test_step_api(tiny_engine):
    ids = tiny_engine.encode("abc", chat=False)
    req = tiny_engine.add_request(ids, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs = [tiny_engine.step(req) for _ in range(3)]
    assert [len(o.token_ids) for o in outs] == [1, 1, 1]
    assert req.finished and req.finish_reason == "length"
    assert req.kv.length == len(ids) + 2  # the cache holds every token but the last
    with pytest.raises(SelfspecError, match="already finished"):
        tiny_engine.step(req)
    tiny_engine.release(req)


def test_seeded_sampling_is_reproducible(tiny_engine):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    a = tiny_engine.generate("x", p).token_ids
    b = tiny_engine.generate("x", p).token_ids
    c = tiny_engine.generate("x", SamplingParams(temperature=1.0, top_p=0.9, seed=8, max_tokens=16, ignore_eos=True))
    assert a == b and a != c.token_ids


def test_stop_token_ids_and_eos(tiny_engine):
    greedy = tiny_engine.generate("q", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)).token_ids
    stop_at = greedy[3]
    first = greedy.index(stop_at)
    r = tiny_engine.generate("q", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(stop_at,)))
    assert r.finish_reason == "stop" and r.token_ids == greedy[: first + 1]


def test_stop_string(tiny_engine):
    full = tiny_engine.generate("q", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    needle = full.text[len(full.text) // 2 :][:3]
    assert needle.strip(), full.text  # the tiny model is initialized to produce varied text
    r = tiny_engine.generate("q", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=(needle,)))
    assert r.finish_reason == "stop"
    assert r.text == full.text[: full.text.index(needle)]


def test_context_limit(tiny_checkpoint):
    engine = Engine.from_pretrained(str(tiny_checkpoint), kv_cache_tokens=32)
    assert engine.max_model_len == 32
    with pytest.raises(SelfspecError, match="context holds 32"):
        engine.generate(list(range(5, 45)), SamplingParams(max_tokens=4))
    r = engine.generate(list(range(5, 25)), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    assert r.finish_reason == "length" and len(r.token_ids) == 32 - 20
    assert engine.cache.num_used_blocks == 0


def test_bad_prompts(tiny_engine):
    with pytest.raises(SelfspecError, match="empty prompt"):
        tiny_engine.generate([], SamplingParams())
    with pytest.raises(SelfspecError, match="token ids must lie in"):
        tiny_engine.generate([1, 10**9], SamplingParams())


def test_blocks_freed_after_generation_and_interruption(tiny_engine):
    tiny_engine.generate("hello", SamplingParams(max_tokens=5))
    assert tiny_engine.cache.num_used_blocks == 0
    stream = tiny_engine.stream_generate("hello", SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    assert tiny_engine.cache.num_used_blocks > 0
    stream.close()  # a consumer that stops early frees its blocks
    assert tiny_engine.cache.num_used_blocks == 0


def test_bfloat16_engine_runs(tiny_checkpoint):
    engine = Engine.from_pretrained(str(tiny_checkpoint), dtype="bfloat16")
    r = engine.generate("hi", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(r.token_ids) == 4
