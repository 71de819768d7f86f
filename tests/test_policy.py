from dataclasses import replace

import pytest

from selfspec.decoding import profile as profile_module
from selfspec.decoding.policy import SpecOverride, SpecPolicy
from selfspec.decoding.profile import PROFILE_VERSION, BucketChoice, Profile, length_bucket, shipped_profile
from selfspec.decoding.round import SpecConfig
from selfspec.decoding.sampling import SamplingParams
from selfspec.errors import SelfspecError
from selfspec.kernels.choice import machine_key


def bucket(cat, lb, t, n, g, predicted, measured=None):
    return BucketChoice(cat, lb, t, 500, {str(n): 0.6}, n, g, predicted, measured)


def synthetic_profile(**kw) -> Profile:
    buckets = [
        bucket("all", "all", 0.0, 10, 3, 1.3),
        bucket("all", "all", 0.3, 10, 2, 1.1),
        bucket("qa", "all", 0.0, 12, 4, 1.5, measured=1.4),
        bucket("translation", "all", 0.0, 10, 3, 1.2, measured=0.9),  # the measurement overrules
        bucket("math", "0-63", 0.0, 8, 2, 0.8),
    ]
    base = dict(
        model="synthetic",
        fingerprint="abc",
        num_layers=30,
        dtype="float32",
        machine=machine_key(),
        temperatures=[0.0, 0.3],
        draft_layers=[8, 10, 12],
        draft_cost={"8": 0.3, "10": 0.35, "12": 0.4},
        verify_cost={"10": {"3": 0.5}},
        buckets=buckets,
        knee=10,
        best_draft_layers=10,
        temperature_threshold=0.5,
        confidence_threshold=0.2,
    )
    base.update(kw)
    return Profile(**base)


def decide(policy, **kw):
    args = dict(num_layers=30, prompt_tokens=100, temperature=0.0, max_tokens=128)
    args.update(kw)
    return policy.decide(**args)


def test_profile_round_trip(tmp_path):
    p = synthetic_profile()
    p.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == p


def test_profile_version_and_garbage(tmp_path):
    bad = tmp_path / "old.json"
    bad.write_text(synthetic_profile(version=PROFILE_VERSION + 1).to_json())
    with pytest.raises(SelfspecError, match="re-run `selfspec calibrate`"):
        Profile.load(bad)
    bad.write_text("{not json")
    with pytest.raises(SelfspecError, match="cannot read profile"):
        Profile.load(bad)
    bad.write_text('{"version": %d, "buckets": [], "model": "x"}' % PROFILE_VERSION)
    with pytest.raises(SelfspecError, match="not a valid selfspec profile"):
        Profile.load(bad)


def test_length_buckets():
    assert [length_bucket(n) for n in (0, 63, 64, 255, 256, 1023, 1024, 9999)] == [
        "0-63",
        "0-63",
        "64-255",
        "64-255",
        "256-1023",
        "256-1023",
        "1024+",
        "1024+",
    ]


def test_policy_switches_on_from_bucket():
    d = decide(SpecPolicy(synthetic_profile()), category="qa")
    assert (d.config.draft_layers, d.config.num_speculative_tokens) == (12, 4)
    assert d.reason == "on: bucket qa/all/T=0 measured 1.40x with exit, N=12, gamma=4" and d.confidence_threshold == 0.2
    d = decide(SpecPolicy(synthetic_profile()), category="unknown-category")  # falls back to all/all
    assert d.config.draft_layers == 10 and "all/all/T=0 predicted 1.30x" in d.reason


def test_the_shipped_profile_of_this_machine_is_chosen(tmp_path, monkeypatch):
    monkeypatch.setattr(profile_module, "PROFILE_DIR", tmp_path)
    other = synthetic_profile(machine=dict(machine_key(), cpu="Some Other CPU", threads=99))
    close = synthetic_profile(machine=dict(machine_key(), cpu="Another CPU"), knee=8)
    other.save(tmp_path / "abc-float32-a.json")
    close.save(tmp_path / "abc-float32-b.json")
    synthetic_profile(dtype="bfloat16").save(tmp_path / "abc-bfloat16-here.json")  # another dtype: not a candidate
    # No profile of this machine: the closest one, which the policy names as foreign.
    assert shipped_profile("abc", "float32") == close
    assert "cpu 'Another CPU'" in SpecPolicy(close).foreign
    # as close by count but on other vector units (an AVX-512 machine's profile on an AVX2 one): not chosen
    units = synthetic_profile(machine=dict(machine_key(), capability="NO SUCH UNITS"))
    units.save(tmp_path / "abc-float32-0.json")
    assert shipped_profile("abc", "float32") == close
    assert "capability 'NO SUCH UNITS'" in SpecPolicy(units).foreign
    here = synthetic_profile(knee=12)
    here.save(tmp_path / "abc-float32-c.json")
    assert shipped_profile("abc", "float32") == here and SpecPolicy(here).foreign is None
    assert shipped_profile("abc", "float16") is None
    # Timed on other kernels: a profile without a backend was timed on `native`
    assert SpecPolicy(here, backend="native").foreign is None
    assert "backend 'native' here 'codes'" in SpecPolicy(here, backend="codes").foreign
    here.machine["backend"] = "codes"
    assert SpecPolicy(here, backend="codes").foreign is None


def test_the_shipped_profile_of_the_models_weight_format_is_chosen(tmp_path, monkeypatch):
    """An int4 model's steps and verification cost what its own kernels do: a profile of this machine's
    float weights is not its profile, nor is an int4 one a float model's."""
    monkeypatch.setattr(profile_module, "PROFILE_DIR", tmp_path)
    floats = synthetic_profile(machine=dict(machine_key(), backend="codes"))
    floats.save(tmp_path / "abc-float32-here.json")
    elsewhere = synthetic_profile(machine=dict(machine_key(), cpu="Another CPU", backend="native4i8", weights="int4"))
    elsewhere.save(tmp_path / "abc-float32-int4-elsewhere.json")
    assert shipped_profile("abc", "float32", "codes") == floats  # no weights key: float weights
    assert shipped_profile("abc", "float32", "native4i8", "int4") == elsewhere  # another CPU, its format
    here = synthetic_profile(machine=dict(machine_key(), backend="native4i8", weights="int4"), knee=12)
    here.save(tmp_path / "abc-float32-int4-here.json")
    assert shipped_profile("abc", "float32", "native4i8", "int4") == here
    assert SpecPolicy(here, backend="native4i8").foreign is None
    assert shipped_profile("abc", "float32", "codes") == floats
    assert "backend 'codes' here 'native4i8'" in SpecPolicy(floats, backend="native4i8").foreign


def test_a_profile_from_another_machine_is_not_trusted_silently():
    profile = synthetic_profile()
    profile.machine = dict(profile.machine, cpu="Some Other CPU")
    d = decide(SpecPolicy(profile), category="qa")
    assert (
        d.config is None and "measured with cpu 'Some Other CPU'" in d.reason and "run selfspec calibrate" in d.reason
    )
    profile.buckets = [replace(b, drafter="lookup", draft_layers=None) for b in profile.buckets]
    d = decide(SpecPolicy(profile), category="qa")
    assert d.config.drafter == "lookup" and "lookup runs no model to draft" in d.reason


def test_only_the_instruction_sets_among_the_flags_make_a_profile_foreign():
    """Two VMs of one CPU model were seen to differ in mitigation flags alone: a profile with this machine's
    instruction sets is trusted whatever its other flags; another instruction set is foreign. Older profiles
    compare what they recorded: `isa` (which took x86's fpu, smep and sme too), or before it every flag."""
    from selfspec.kernels.cache import isa, legacy_isa

    line = "fpu vme md_clear avx2 hypervisor amx_bf16 avx512f flush_l1d sse4_2 smep sme sha_ni"
    assert isa(line, "x86_64") == "amx_bf16 avx2 avx512f sha_ni sse4_2"  # not fpu, smep, nor AMD's sme
    assert legacy_isa(line) == "amx_bf16 avx2 avx512f fpu sha_ni sme smep sse4_2"  # what older profiles hashed
    assert isa("fp asimd evtstrm sve sme i8mm cpuid", "aarch64") == "asimd fp i8mm sme sve"  # Arm's SME
    profile = synthetic_profile()
    profile.machine = dict(profile.machine, flags="0123456789ab", isa="0123456789ab")
    assert SpecPolicy(profile).foreign is None  # the instruction sets agree: other flags and `isa` do not count
    profile.machine["instruction_sets"] = "ba9876543210"
    assert "instruction_sets 'ba9876543210'" in SpecPolicy(profile).foreign
    del profile.machine["instruction_sets"]  # a profile from before them compares `isa`
    assert "isa '0123456789ab'" in SpecPolicy(profile).foreign
    del profile.machine["isa"]  # and one from before `isa`, every flag
    assert "flags '0123456789ab'" in SpecPolicy(profile).foreign


def test_policy_switches_off_and_says_why():
    policy = SpecPolicy(synthetic_profile())
    assert decide(policy, temperature=0.9).reason == "off: temperature 0.9 > threshold 0.5"
    assert decide(policy, max_tokens=4).reason == "off: max_tokens 4 < 16, too short to pay"
    assert policy.allows_batch(8) and not policy.allows_batch(9)  # the scheduler turns speculation off above 8
    d = decide(policy, category="translation")
    assert (
        d.config is None and d.reason == "off: bucket translation/all/T=0 measured 0.90x at best (exit, N=10, gamma=3)"
    )
    d = decide(policy, category="math", prompt_tokens=10)
    assert d.config is None and "predicted 0.80x" in d.reason
    d = decide(SpecPolicy(None))
    assert d.config is None and "no calibration profile" in d.reason
    assert decide(SpecPolicy(None), temperature=0.8).reason == "off: temperature 0.8 > threshold 0.7"


def test_request_override():
    policy = SpecPolicy(synthetic_profile())
    assert decide(policy, override=SpecOverride(enabled=False), category="qa").config is None
    d = decide(policy, override=SpecOverride(enabled=True), temperature=0.9)  # forced on despite the threshold
    assert d.config.draft_layers == 10 and d.reason.startswith("on: requested")
    d = decide(SpecPolicy(None), override=SpecOverride(draft_layers=6, num_speculative_tokens=2))
    assert (d.config.draft_layers, d.config.num_speculative_tokens) == (6, 2)
    with pytest.raises(ValueError, match="num_speculative_tokens=99"):
        SpecOverride(num_speculative_tokens=99)
    with pytest.raises(ValueError, match="enabled='yes'"):
        SpecOverride(enabled="yes")


def test_override_picks_the_drafter():
    d = SpecPolicy(None).decide(
        num_layers=30, prompt_tokens=10, temperature=0.0, max_tokens=64, override=SpecOverride(drafter="exit")
    )
    assert d.config is not None and d.config.drafter == "exit" and d.reason.startswith("on: requested")
    with pytest.raises(ValueError, match="drafter='lookahead' is invalid"):
        SpecOverride(drafter="lookahead")


def test_batched_rounds_take_the_gamma_calibration_measured_batches_at():
    measured = [
        {"batch_size": b, "drafter": "hybrid", "gamma": g, "measured_speedup": 1.1} for b, g in ((2, 3), (4, 5))
    ]
    policy = SpecPolicy(synthetic_profile(batching=measured))
    assert [policy.batch_gamma(n) for n in (1, 2, 3, 4, 8)] == [None, 3, 5, 5, 5]
    assert SpecPolicy(synthetic_profile()).batch_gamma(4) is None and SpecPolicy(None).batch_gamma(4) is None
    args = dict(num_layers=30, prompt_tokens=100, params=SamplingParams(temperature=0.0))
    assert policy.resolve("auto", **args).policy_gamma  # the bucket's γ: a batch may cap it
    assert not policy.resolve(SpecOverride(num_speculative_tokens=4), **args).policy_gamma  # the request's: kept
    assert not policy.resolve(SpecConfig(10, 4), **args).policy_gamma
