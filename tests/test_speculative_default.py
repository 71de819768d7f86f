"""Self-speculative decoding on the default model (SmolLM2-135M-Instruct, fp32): token-for-token greedy
equivalence on dev prompts, and a two-sample test of sampled sequence log-likelihoods."""

import pytest
import torch

from selfspec import SamplingParams, SpecConfig
from selfspec.calibration.distribution import compare
from selfspec.kernels import native

from .conftest import dev_prompts

PROMPTS = dev_prompts(8)
GAMMA = {8: 1, 15: 2, 24: 3}  # short drafts: untrained exits accept little, and CI time is finite


def share(configs: list, i: int) -> list[str]:
    """The prompts that configuration i of `configs` checks: every prompt is checked by one of them, in
    turn, so the suite covers all prompts and all configurations at the cost of one pass over the
    prompts (`selfspec bench` checks every configuration on every prompt)."""
    return PROMPTS[i :: len(configs)]


@pytest.fixture(scope="module")
def plain_outputs(default_engine):
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    return {p: default_engine.generate(p, params, speculation=None).token_ids for p in PROMPTS}


@pytest.mark.parametrize("draft_layers", list(GAMMA))
def test_greedy_equals_plain_on_dev_prompts(default_engine, plain_outputs, draft_layers):
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    spec = SpecConfig(draft_layers, GAMMA[draft_layers])
    for prompt in share(list(GAMMA), list(GAMMA).index(draft_layers)):
        result = default_engine.generate(prompt, params, speculation=spec)
        assert result.token_ids == plain_outputs[prompt], f"diverged on {prompt[:60]!r}"


DRAFTERS = [("lookup", 5), ("int4", 2), ("hybrid", 3)]


@pytest.mark.parametrize("drafter,gamma", DRAFTERS)
def test_drafters_greedy_equal_plain_on_dev_prompts(default_engine, plain_outputs, drafter, gamma):
    """The quantized self-draft (the GGUF's own codes), lookup and the hybrid: drafts never change
    the fp32 output."""
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    accepted = 0
    for prompt in share(DRAFTERS, DRAFTERS.index((drafter, gamma))):
        result = default_engine.generate(prompt, params, speculation=SpecConfig(None, gamma, drafter))
        assert result.token_ids == plain_outputs[prompt], f"{drafter} diverged on {prompt[:60]!r}"
        accepted += result.stats.spec.accepted
    assert accepted > 0


def test_active_kernels_are_row_exact(default_engine, int4_engine):
    """What the equality above rests on: every linear gives a row the same bits in a k-row
    verification as in a 1-row plain step (oneDNN prepacked fp32, int4)."""
    for engine in (default_engine, int4_engine):
        assert engine.model.kernels.row_exact, engine.model.kernels
        # and the glue between them: native.c's fused ops where this machine can build them (test_native.py)
        assert engine.model.ops.name == ("eager" if native.library() is None else "fused")


INT4_CONFIGS = [
    SpecConfig(15, 3),
    SpecConfig(None, 4, "lookup"),
    SpecConfig(None, 2, "hybrid"),
    SpecConfig(None, 2, "int4"),
]


def test_int4_greedy_equals_plain_on_dev_prompts(int4_engine):
    """The 4-bit target: speculation over int4 linears equals plain decoding with them, for an exit, the
    lookup, the hybrid and the int4 draft (which reads the target's own linears), one prompt each."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for prompt, config in zip(PROMPTS[:4], INT4_CONFIGS):
        plain = int4_engine.generate(prompt, params, speculation=None)
        result = int4_engine.generate(prompt, params, speculation=config)
        assert result.stats.weights == "int4" and result.stats.spec.rounds > 0
        assert result.stats.ops == int4_engine.model.ops.name
        assert result.token_ids == plain.token_ids, f"{config.drafter} diverged on {prompt[:60]!r}"


def test_an_int4_targets_draft_reads_its_layers_and_it_has_its_own_profile(int4_engine):
    """`--weights int4`: the int4 draft is the target's own layers under the shortlisted head (no second
    66 MB copy), and the policy takes the shipped profile measured with int4 weights, not a float one."""
    target = int4_engine.model
    drafter = int4_engine.drafter(SpecConfig(None, 2, "int4"))
    for mine, theirs in zip(drafter.draft.layers, target.layers):
        assert all(a is b for a, b in zip(mine.linears(), theirs.linears()))
    assert drafter.memory_bytes == drafter.draft.head.coarse.nbytes
    profile = int4_engine.policy.profile
    assert profile is not None and profile.machine.get("weights") == "int4", profile and profile.machine


@torch.inference_mode()
def test_sampled_logliks_match_plain(default_engine):
    """500 sampled continuations (4 tokens, T=0.8) with and without speculation: KS test on their
    log-likelihoods and chi-square on the first token, each at the 1% level (fixed seeds)."""
    engine = default_engine
    prompt = engine.encode(PROMPTS[1])
    params = SamplingParams(temperature=0.8)
    report = compare(engine.model, prompt, params, SpecConfig(24, 2), samples=500, new_tokens=4, seed=1)
    assert report.lossless, report


@torch.inference_mode()
def test_sampled_logliks_match_plain_with_the_hybrid(default_engine):
    """The same two-sample test with the hybrid drafter: lookup rows (point masses) and int4 rows
    (their own q) in one batch."""
    engine = default_engine
    prompt = engine.encode(PROMPTS[2])
    config = SpecConfig(None, 2, "hybrid")
    params = SamplingParams(temperature=0.8)
    report = compare(engine.model, prompt, params, config, 500, 4, 2, drafter=engine.drafter(config))
    assert report.lossless, report


def test_preload_loads_the_copies_the_profile_drafts_with(default_engine):
    """A server loads its quantized drafts before the first request (`selfspec serve`, bench)."""
    used = {b.drafter for b in default_engine.policy.profile.buckets}
    expected = {w for w in ("int4", "int8") if w in used or (w == "int4" and "hybrid" in used)}
    default_engine.preload()
    assert expected and expected <= set(default_engine._draft_models)
