"""Calibration on tiny models: teacher-forced acceptance, the round model, the adaptive-stop cutoff,
a full calibrate run (profile, plots, resume), the policy it feeds, and the roofline and bench commands."""

import json
import math
import time
from types import SimpleNamespace

import pytest
import torch

from selfspec import Engine, SamplingParams
from selfspec.calibration.calibrate import (
    BATCH_MARGIN,
    AcceptanceRecord,
    BucketEstimate,
    CalibrationPlan,
    _validate,
    batch_limit,
    confidence_threshold,
    costs_at,
    estimate_buckets,
    teacher_forced_acceptance,
    tokens_per_round,
)
from selfspec.calibration.roofline import CACHE_SIZES_MB, cache_edge
from selfspec.cli.main import main
from selfspec.decoding.profile import Profile
from selfspec.decoding.round import SpecConfig
from selfspec.kernels.choice import QUANTIZED

from .conftest import DEV_SET, tiny_hf_model
from .test_model_parity import ours


def test_knee_of_acceptance_curve():
    from selfspec.calibration.calibrate import knee

    flat_then_rising = {"4": 0.05, "8": 0.05, "12": 0.06, "16": 0.1, "20": 0.3, "24": 0.6}
    assert knee(flat_then_rising) == 16
    assert knee({"2": 0.1, "4": 0.2}) == 4


def test_tokens_per_round_by_hand():
    """Rounds start where the previous round's tokens end (positions 0 and 3 here, not every one)."""
    assert tokens_per_round([1, 1, 1, 1], 2) == pytest.approx((3 + 2) / 2)  # the last round sees 1 left
    assert tokens_per_round([0, 0, 0], 4) == 1.0
    assert tokens_per_round([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)  # 1.75 tokens: the next starts at 2


def test_a_long_accepted_run_counts_as_the_rounds_that_pass_over_it():
    """10 misses, a 20-position run a draft gets right, 10 misses, γ = 5: a decode makes 10 + 4 + 9
    rounds (6, 6, 6 and 3 tokens from the run's start; the last one's 3 reach past it), not 40 with
    20 of them at up to 6 tokens."""
    accept = [0] * 10 + [1] * 20 + [0] * 10
    assert tokens_per_round(accept, 5) == pytest.approx((10 + 6 + 6 + 6 + 3 + 9) / 23)


def test_validation_times_decoding_not_the_prompt():
    """The prediction covers decoding; a long prompt's prefill, the same work either way, would pull a
    wall-clock ratio towards 1. Stub decodes: plain 0.4 s, speculative 0.2 s, each after a 0.05 s
    'prefill' outside the decoding time."""

    class Stub:
        def encode(self, prompt):
            return [1, 2, 3]

        def generate(self, ids, params, speculation=None):
            time.sleep(0.05)
            return SimpleNamespace(stats=SimpleNamespace(decode_seconds=0.2 if speculation else 0.4))

    est = BucketEstimate("all", "all", 0.0, 10, {"int4": 0.9}, {"int4": {"4": 4.0}}, {"int4": {"4": 1.9}})
    plan = CalibrationPlan([], [4], [0.0], validate_prompts=2)
    questions = [{"question_id": i, "category": "qa", "turns": ["hi"]} for i in range(2)]
    rows = _validate(Stub(), questions, [est], plan)
    assert rows and all(r["measured_speedup"] == 2.0 for r in rows)


@pytest.mark.parametrize(
    "speedups,limit,timed",
    [
        ({2: 0.8, 4: 2.0, 8: 2.0}, 1, [2]),
        ({2: 1.4, 4: 0.9, 8: 2.0}, 2, [2, 4]),
        ({2: 1.5, 4: 1.05, 8: 2.0}, 2, [2, 4]),  # above 1.0x but within the margin
        ({2: 1.5, 4: 1.2, 8: 1.15}, 8, [2, 4, 8]),
    ],
)
def test_batch_limit_stops_at_the_first_batch_size_that_does_not_pay(monkeypatch, speedups, limit, timed):
    """Never / partly / always paying: the limit is the largest size before the first below BATCH_MARGIN,
    and no size above that one is timed. Stub timings: plain 1 s, speculative 1 / speedup at γ 3 and
    slower at the smaller γ batch_limit also tries."""
    from selfspec.calibration import calibrate as calibration

    calls = []

    def seconds(engine, batch, params, spec, speculate):
        calls.append((len(batch), speculate and spec.num_speculative_tokens))
        if not speculate:
            return 1.0
        return (1.0 if spec.num_speculative_tokens == 3 else 1.1) / speedups[len(batch)]

    monkeypatch.setattr(calibration, "_batch_seconds", seconds)
    engine = SimpleNamespace(cache=SimpleNamespace(capacity_tokens=10_000))
    prompts = [[1] * 20] * 3
    got, rows = batch_limit(
        engine, prompts, SpecConfig(num_speculative_tokens=3, drafter="int4"), CalibrationPlan([], [3], [0.0])
    )
    assert got == limit and [r["batch_size"] for r in rows] == timed
    assert [r["measured_speedup"] for r in rows] == pytest.approx([speedups[b] for b in timed])
    assert all(r["gamma"] == 3 and set(r["by_gamma"]) == {"2", "3"} for r in rows)
    trials = calibration.BATCH_TRIALS
    assert sorted(calls) == sorted((b, s) for b in timed for s in (False, 2, 3) for _ in range(trials))
    # a size whose requests would not fit the cache is not measured, nor any above it
    engine.cache.capacity_tokens = 3 * (20 + 64 + 3 + 2)  # room for 3 requests: batches of 2 only
    got, rows = batch_limit(
        engine, prompts, SpecConfig(num_speculative_tokens=3, drafter="int4"), CalibrationPlan([], [3], [0.0])
    )
    assert [r["batch_size"] for r in rows] == [2] and got == (2 if speedups[2] >= 1.0 else 1)


def test_batch_limit_keeps_each_size_at_its_best_gamma(monkeypatch):
    """A batch of 4 that pays only at a smaller γ than a request alone's best: that size is kept, at that
    γ (the γ policy.batch_gamma caps its batches at), and a size paying at no γ ends the limit."""
    from selfspec.calibration import calibrate as calibration

    speedup = {(2, 2): 1.3, (2, 4): 1.5, (2, 8): 1.6, (4, 2): 1.2, (4, 4): 1.25, (4, 8): 0.9}
    speedup |= {(8, 2): 0.9, (8, 4): 0.8, (8, 8): 0.6}

    def seconds(engine, batch, params, spec, speculate):
        return 1.0 / speedup[len(batch), spec.num_speculative_tokens] if speculate else 1.0

    monkeypatch.setattr(calibration, "_batch_seconds", seconds)
    engine = SimpleNamespace(cache=SimpleNamespace(capacity_tokens=10_000))
    got, rows = batch_limit(
        engine, [[1] * 20], SpecConfig(num_speculative_tokens=8, drafter="int4"), CalibrationPlan([], [8], [0.0])
    )
    assert got == 4
    assert [(r["batch_size"], r["gamma"]) for r in rows] == [(2, 8), (4, 4), (8, 2)]
    assert rows[1]["by_gamma"] == pytest.approx({"2": 1.2, "4": 1.25, "8": 0.9})


def test_batch_limit_takes_the_median_of_batches_of_other_prompts(monkeypatch):
    """Each size is timed on BATCH_TRIALS batches of different prompts: one trial's outlier (a VM slowed
    mid-run) neither makes a size pay nor stops the limit; the median decides."""
    from selfspec.calibration import calibrate as calibration

    monkeypatch.setattr(calibration, "BATCH_TRIALS", 3)
    seen, ratio = [], {2: [1.5, 0.5, 1.4], 4: [2.0, 1.0, 0.9], 8: [1.3, 1.3, 1.3]}

    def seconds(engine, batch, params, spec, speculate):
        if not speculate:
            seen.append((len(batch), tuple(ids[0] for ids in batch)))
            return 1.0
        return 1.0 / ratio[len(batch)][batch[0][0] // len(batch)]  # trial t's batch starts at prompt t * B

    monkeypatch.setattr(calibration, "_batch_seconds", seconds)
    engine = SimpleNamespace(cache=SimpleNamespace(capacity_tokens=10_000))
    prompts = [[i] * 20 for i in range(10)]
    got, rows = batch_limit(
        engine, prompts, SpecConfig(num_speculative_tokens=2, drafter="int4"), CalibrationPlan([], [2], [0.0])
    )
    assert got == 2 and [r["batch_size"] for r in rows] == [2, 4]
    assert rows[0]["measured_speedup"] == pytest.approx(1.4) and rows[0]["trials"]["2"] == pytest.approx(
        [1.5, 0.5, 1.4]
    )
    assert rows[1]["measured_speedup"] == pytest.approx(1.0)
    assert len({batch for b, batch in seen if b == 2}) == 3  # three batches of other prompts


def test_confidence_threshold_drops_unprofitable_drafts():
    rec = AcceptanceRecord("q", "c", 10, 0.0, {"4": [0, 0, 1, 1, 1]}, {"4": [0.1, 0.2, 0.6, 0.7, 0.9]})
    tau = confidence_threshold([rec], "4", c=0.3)
    assert tau == math.nextafter(0.2, 1.0)  # drafts at 0.1 and 0.2 never pay; the rest do
    all_good = AcceptanceRecord("q", "c", 10, 0.0, {"4": [1, 1]}, {"4": [0.1, 0.2]})
    assert confidence_threshold([all_good], "4", c=0.3) == 0.0


@torch.inference_mode()
def test_teacher_forced_acceptance_is_exact():
    hf = tiny_hf_model("llama", vocab_size=64, num_hidden_layers=4, initializer_range=0.3)
    model = ours(hf)
    cache = model.new_cache(256)
    prompt, cont = [3, 9, 4], [7, 1, 22, 5, 5]
    accept, top, *_ = teacher_forced_acceptance(model, cache, prompt, cont, [1, 3], 0.0)
    tokens = torch.tensor([prompt + cont])
    full = hf(tokens, output_hidden_states=True)
    target = full.logits[0, 2:-1].argmax(-1)
    for n in (1, 3):
        draft = model.logits(full.hidden_states[n][0, 2:-1]).argmax(-1)
        assert accept[str(n)] == (draft == target).float().tolist()
        assert len(top[str(n)]) == len(cont)
    sampled, *_ = teacher_forced_acceptance(model, cache, prompt, cont, [2], 0.7)
    assert all(0.0 <= b <= 1.0 for b in sampled["2"])
    for layer in model.layers[2:]:  # upper layers add nothing: the exit at 2 is the model
        layer.o = model.make_linear(torch.zeros(layer.o.out_features, layer.o.in_features))
        layer.down = model.make_linear(torch.zeros(layer.down.out_features, layer.down.in_features))
    same, *_ = teacher_forced_acceptance(model, cache, prompt, cont, [2], 0.7)
    assert same["2"] == pytest.approx([1.0] * len(cont), abs=1e-5)
    assert cache.num_used_blocks == 0


@pytest.mark.parametrize("kind", ["affine", "attn"])
@torch.inference_mode()
def test_teacher_forced_acceptance_with_a_draft_head(kind):
    """With a head at N, N's acceptance is the head's (equal to drafting with it step by step) and
    the plain exit's is kept beside it."""
    from selfspec.decoding.head import build, new_adapter

    model = ours(tiny_hf_model("llama", vocab_size=64, num_hidden_layers=4, initializer_range=0.3))
    torch.manual_seed(1)
    adapter = new_adapter(model, kind, rank=8)
    for p in adapter.parameters():
        p.normal_(0, 0.3)
    head = build(model, 2, adapter, None)
    cache = model.new_cache(256)
    prompt, cont = [3, 9, 4], [7, 1, 22, 5, 5, 9, 13, 2]
    accept, _, plain, _ = teacher_forced_acceptance(model, cache, prompt, cont, [1, 2], 0.0, {2: head})
    without, _, none, _ = teacher_forced_acceptance(model, cache, prompt, cont, [1, 2], 0.0)
    assert plain == {"2": without["2"]} and none == {} and accept["1"] == without["1"]
    seq = cache.allocate()  # drafting step by step with the head agrees with its teacher-forced form
    stepwise = []
    tokens = prompt + cont
    for i, t in enumerate(tokens[:-1]):
        batch = cache.prepare([seq], [1])
        if i < len(prompt) - 1:  # the prompt's own positions: cache only
            model.forward(torch.tensor([[t]]), cache, batch=batch)
        else:
            h2 = model.forward(torch.tensor([[t]]), cache, end=2, batch=batch)
            draft = head.draft(h2, batch, cache).argmax(-1)
            full = model.logits(model.forward(h2, cache, start=2, batch=batch)[:, -1]).argmax(-1)
            stepwise.append(float(draft == full))
    assert accept["2"] == stepwise


@pytest.fixture(scope="module")
def calibrated(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("calib")
    argv = [
        "calibrate",
        "--model",
        str(tiny_checkpoint),
        "--data",
        str(DEV_SET),
        "--draft-layers",
        "1:3:1",
        "--gammas",
        "1-3",
        "--temperatures",
        "0,0.7",
        "--per-category",
        "1",
        "--new-tokens",
        "12",
        "--out",
        str(out / "profile.json"),
        "--plot",
        str(out / "plots"),
        "--json",
    ]
    assert main(argv) == 0
    return out, argv


def test_calibrate_writes_profile_and_plots(calibrated, capsys):
    out, _ = calibrated
    profile = Profile.load(out / "profile.json")
    assert profile.num_layers == 4 and profile.draft_layers == [1, 2, 3] and profile.temperatures == [0.0, 0.7]
    assert set(profile.draft_cost) == {"1", "2", "3", "int4", "lookup"} and all(
        c > 0 for c in profile.draft_cost.values()
    )
    # timed at the first prompt's context and at the longest prompt's
    assert len(profile.cost_contexts) == 2 and profile.cost_contexts[0]["draft_cost"] == profile.draft_cost
    assert profile.cost_contexts[1]["tokens"] >= 2 * profile.cost_contexts[0]["tokens"]
    cats = {b.category for b in profile.buckets}
    # the tiny model's 512-token context leaves out the long summarization and RAG prompts, and says so
    assert len(profile.skipped_prompts) == 2
    assert "all" in cats and "translation" in cats and len(cats) == 1 + 13 - 2
    for b in profile.buckets:
        assert b.drafter in ("auto", "int4", "lookup", "hybrid") and 1 <= b.gamma <= 3 and b.positions > 0
        assert 1 <= b.draft_layers <= 3 if b.drafter == "auto" else b.draft_layers is None
        assert all(0.0 <= a <= 1.0 for a in b.alpha.values())
    assert any(v["measured_speedup"] > 0 for v in profile.validation)
    # batches of 2, 4, ... timed speculative against plain, as far as they pay and fit the cache
    assert profile.batching and profile.batching[0]["batch_size"] == 2
    assert all(b["measured_speedup"] > 0 for b in profile.batching)
    expected = 1
    for b in profile.batching:  # a size pays from BATCH_MARGIN up: one between 1.0x and it ends the search
        if b["measured_speedup"] < BATCH_MARGIN:
            break
        expected = b["batch_size"]
    assert profile.max_batch_size == expected
    for name in ("acceptance_vs_depth.png", "speedup_vs_gamma.png", "acceptance_heatmap.png"):
        assert (out / "plots" / name).stat().st_size > 5000


def test_calibrate_resumes_from_partial_results(calibrated, monkeypatch, capsys):
    out, argv = calibrated
    from selfspec.calibration import calibrate as calibration

    def boom(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(calibration, "teacher_forced_acceptance", boom)
    monkeypatch.setattr(calibration, "time_costs", boom)
    assert main(argv) == 0  # every record and the costs come from <out>.partial.jsonl
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    best = {(e["source"], e["temperature"]): e for e in summary["sources"]}  # each source's best γ over all prompts
    assert set(best) == {(s, t) for s in ("1", "2", "3", "int4", "lookup", "hybrid") for t in (0.0, 0.7)}
    assert all(1 <= e["gamma"] <= 3 and e["predicted_speedup"] > 0 for e in best.values())


def test_partial_results_timed_with_other_kernels_do_not_resume(calibrated, monkeypatch, capsys):
    """Costs timed on another backend (or native.c version, or machine) are not reused: the run stops and
    says so, as it does for other draft heads."""
    out, argv = calibrated
    from selfspec.calibration import calibrate as calibration

    key = calibration.machine_key()
    monkeypatch.setattr(calibration, "machine_key", lambda: {**key, "isa": "0123456789ab"})
    assert main(argv) == 2
    assert "timed with other kernels or on another machine" in capsys.readouterr().err


def test_engine_follows_its_profile(calibrated, tiny_checkpoint):
    out, _ = calibrated
    profile = Profile.load(out / "profile.json")
    for b in profile.buckets:  # make every bucket pay so the policy switches speculation on
        b.measured_speedup = 1.5
    engine = Engine.from_pretrained(str(tiny_checkpoint), profile=profile)
    r = engine.generate("hello", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), category="qa")
    assert r.stats.spec_policy.startswith("on: bucket qa/0-63/T=0 measured 1.50x") and r.stats.spec is not None
    plain = engine.generate("hello", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), speculation=None)
    assert r.token_ids == plain.token_ids and plain.stats.spec_policy == "off: disabled by the request"
    hot = engine.generate("hello", SamplingParams(temperature=0.95, max_tokens=20))
    assert hot.stats.spec is None and hot.stats.spec_policy.startswith("off: temperature 0.95 > threshold")


def test_adaptive_draft_stop(tiny_checkpoint):
    from selfspec.decoding.round import SpecConfig

    engine = Engine.from_pretrained(str(tiny_checkpoint))
    req = engine.add_request(
        engine.encode("hi"), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), SpecConfig(2, 5)
    )
    req.confidence_threshold = 1.01  # no draft is ever that confident: every round stops after one draft
    while not req.finished:
        engine.step(req)
    s = req.stats.spec
    assert s.drafted == s.rounds and s.drafted_per_position[1:] == [0, 0, 0, 0]
    engine.release(req)


def test_calibrate_bad_arguments(capsys, tiny_checkpoint, tmp_path):
    assert main(["calibrate", "--data", "/nope.jsonl", "--out", str(tmp_path / "p.json")]) == 2
    assert "--data /nope.jsonl: no such file" in capsys.readouterr().err
    assert main(["calibrate", "--data", str(DEV_SET), "--gammas", "a-b", "--out", "x"]) == 2
    assert "'a-b' is not a list of integers" in capsys.readouterr().err
    args = [
        "calibrate",
        "--model",
        str(tiny_checkpoint),
        "--data",
        str(DEV_SET),
        "--draft-layers",
        "2:6:2",
        "--out",
        str(tmp_path / "p.json"),
    ]
    assert main(args) == 2
    assert "this model has 4 layers" in capsys.readouterr().err


def test_roofline_on_tiny_model(tiny_checkpoint, tmp_path, capsys):
    assert (
        main(
            ["roofline", "--model", str(tiny_checkpoint), "--max-k", "4", "--compare", "int4", "--json"]
            + ["--out", str(tmp_path / "roof")]
        )
        == 0
    )
    both = json.loads(capsys.readouterr().out)
    assert set(both) == {"float32", "int4"}
    r, q = both["float32"], both["int4"]
    assert r["bandwidth_gb_s"] > 0 and r["weight_bytes"] > 0 and r["step_ms"] > 0
    assert set(r["k_costs"]) == {"1", "2", "3", "4"} and r["k_costs"]["1"] == 1.0
    assert r["linear_ms"] > 0 and abs(r["linear_ms"] + r["other_ms"] - r["step_ms"]) < 1e-6
    assert sum(q["backends"].values()) == sum(r["backends"].values()) and q["weight_bytes"] < r["weight_bytes"] / 4
    assert len(q["backends"]) == 1 and set(q["backends"]) <= {b.name for b in QUANTIZED["int4"]}  # the measured one
    assert json.loads((tmp_path / "roof.json").read_text())["machine"]["cores"] > 0
    assert "measured / bound" in (tmp_path / "roof.md").read_text()
    assert set(r["cache_curve"]) == {str(mb) for mb in CACHE_SIZES_MB} and min(r["cache_curve"].values()) > 0
    assert r["cache_mb"] in (0, *CACHE_SIZES_MB) and (r["cache_mb"] == 0) == (r["cache_bandwidth_gb_s"] == 0)


def test_cache_edge_is_where_reads_fall_to_memorys_speed():
    """The largest size read at least CACHE_SPEEDUP x memory's bandwidth, counting up until one is not
    (a later fast reading, a neighbour gone quiet, does not extend it); none where the smallest is slow."""
    curve = {8: 50.0, 16: 52.0, 32: 48.0, 64: 49.0, 96: 44.0, 128: 27.0, 192: 45.0, 256: 21.0}
    assert cache_edge(curve, 21.0) == (96, 49.0)
    assert cache_edge(curve, 40.0) == (0, 0.0)
    assert cache_edge({8: 30.0, 16: 29.0}, 20.0) == (16, 29.5)


def test_bench_on_tiny_model(tiny_checkpoint, tmp_path, capsys):
    prefix = tmp_path / "bench"
    argv = [
        "bench",
        "--model",
        str(tiny_checkpoint),
        "--data",
        str(DEV_SET),
        "--compare",
        "plain,selfspec:2:2,hf,hf-prompt-lookup",
        "--max-tokens",
        "16",
        "--out",
        str(prefix),
        "--json",
    ]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    overall = {s["method"]: s for s in summary if s["category"] == "all"}
    # 11 of the 13 prompts fit the tiny model's 512-token context
    assert overall["selfspec:2:2"]["identical"] == overall["selfspec:2:2"]["prompts"] == 11  # lossless
    assert overall["plain"]["speedup"] == 1.0 and overall["plain"]["mean_accepted_tokens"] == 1.0
    assert overall["hf"]["identical"] == 11  # transformers' greedy agrees with ours
    # Decoding-only speedups for selfspec's own methods (their stats time the prefill apart), none for peers.
    assert overall["plain"]["decode_speedup"] == 1.0 and overall["selfspec:2:2"]["decode_speedup"] > 0
    assert overall["hf"]["decode_speedup"] is None
    assert "Decoding only" in prefix.with_suffix(".md").read_text()
    for suffix in (".json", ".md", ".png"):
        assert prefix.with_suffix(suffix).is_file()
    assert main(["bench", "--data", str(DEV_SET), "--compare", "plain,nonsense"]) == 2


def test_calibrate_with_a_draft_head(tiny_checkpoint, tmp_path, capsys):
    """--draft-head: its depth is calibrated with the head, and the profile keeps α with and without it."""
    from selfspec.decoding.head import build, new_adapter

    model = Engine.from_pretrained(str(tiny_checkpoint)).model
    torch.manual_seed(2)
    adapter = new_adapter(model, "attn", rank=8)
    with torch.no_grad():
        for p in adapter.parameters():
            p.normal_(0, 0.2)
    held = [str(json.loads(line)["question_id"]) for line in DEV_SET.read_text().splitlines()[:40:13]]
    meta = {"heldout_question_ids": held}
    build(model, 2, adapter, torch.arange(0, model.config.vocab_size, 2), meta).save(tmp_path / "head.safetensors")
    argv = [
        "calibrate",
        "--model",
        str(tiny_checkpoint),
        "--data",
        str(DEV_SET),
        "--draft-layers",
        "1:2:1",
        "--gammas",
        "1-2",
        "--temperatures",
        "0",
        "--per-category",
        "3",
        "--new-tokens",
        "8",
        "--out",
        str(tmp_path / "profile.json"),
        "--draft-head",
        str(tmp_path / "head.safetensors"),
        "--json",
    ]
    assert main(argv) == 0
    capsys.readouterr()
    profile = Profile.load(tmp_path / "profile.json")
    assert profile.prompts == held  # only what the head's training held out
    summary = profile.draft_heads["2"]
    assert summary["kind"] == "attn" and summary["vocab_subset"] == model.config.vocab_size // 2
    row = summary["acceptance"]["0"]
    assert 0 <= row["alpha_with_head"] <= 1 and 0 <= row["alpha_plain_exit"] <= 1
    assert row["alpha_with_head"] != row["alpha_plain_exit"]  # a random head drafts differently
    assert "1" not in profile.draft_heads
    no_head = argv[: argv.index("--draft-head")] + ["--no-draft-head", "--json"]
    assert main(no_head) == 2  # its partial results were measured with the head: no silent mix
    assert "measured with draft heads" in capsys.readouterr().err


def test_bench_heldout_only_uses_the_heads_heldout_prompts(tiny_checkpoint, tmp_path, capsys):
    from selfspec.decoding.head import build, new_adapter

    model = Engine.from_pretrained(str(tiny_checkpoint)).model
    ids = [json.loads(line)["question_id"] for line in DEV_SET.read_text().splitlines()[:40:13]]  # 4 prompts
    head = build(model, 2, new_adapter(model, "affine"), None, {"heldout_question_ids": [str(i) for i in ids]})
    head.save(tmp_path / "head.safetensors")
    prefix = tmp_path / "bench"
    argv = [
        "bench",
        "--model",
        str(tiny_checkpoint),
        "--data",
        str(DEV_SET),
        "--compare",
        "plain,selfspec:2:1,selfspec:2:1:exit",
        "--max-tokens",
        "8",
        "--draft-head",
        str(tmp_path / "head.safetensors"),
        "--heldout-only",
        "--per-category",
        "100",
        "--out",
        str(prefix),
        "--json",
    ]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    overall = {s["method"]: s for s in summary if s["category"] == "all"}
    assert overall["selfspec:2:1"]["identical"] == overall["selfspec:2:1:exit"]["identical"] == 4
    meta = json.loads(prefix.with_suffix(".json").read_text())["meta"]
    assert meta["questions"] == [str(i) for i in ids] and meta["draft_heads"] == {
        "2": {"kind": "affine", "vocab_subset": 0}
    }
    assert main(argv[:-8] + ["--no-draft-head", "--heldout-only", "--out", str(prefix)]) == 2
    assert "no draft head with held-out prompts" in capsys.readouterr().err


def test_a_bucket_is_estimated_with_the_costs_at_its_own_context():
    """A draft step pays attention over the whole context as a full step does, so c and v are timed at a
    short and a long context, and each bucket reads them at its own mean context (linear between)."""
    short = {"tokens": 100, "c": {"int4": 0.25}, "v": {"int4": {"1": 1.0, "2": 1.1}}}
    long = {"tokens": 900, "c": {"int4": 0.45}, "v": {"int4": {"1": 1.2, "2": 1.5}}}
    costs = {**short, "at": [short, long]}
    assert costs_at(costs, 50) == (short["c"], short["v"])  # the nearest timing beyond the ends
    c, v = costs_at(costs, 500)
    assert c["int4"] == pytest.approx(0.35) and v["int4"]["2"] == pytest.approx(1.3)
    assert costs_at(short, 900) == (short["c"], short["v"])  # timed at one context: the same at any
    recs = [
        AcceptanceRecord("a", "qa", 40, 0.0, {"int4": [1.0] * 20}),
        AcceptanceRecord("b", "rag", 880, 0.0, {"int4": [1.0] * 20}),
    ]
    found = estimate_buckets(recs, short["c"], short["v"], lambda n: costs_at(costs, n))
    est = {(e.category, e.length_bucket): e.speedup["int4"]["2"] for e in found}
    # every draft kept: γ + 1 tokens a round, for γ c + v at the bucket's context (prompt + 20 / 2 tokens)
    assert est[("qa", "0-63")] == pytest.approx(3 / (2 * 0.25 + 1.1))
    c, v = costs_at(costs, 890)
    assert est[("rag", "256-1023")] == pytest.approx(3 / (2 * c["int4"] + v["int4"]["2"]))
    assert est[("rag", "256-1023")] < est[("all", "all")] < est[("qa", "0-63")]
