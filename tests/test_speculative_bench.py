"""benchmarks/speculative.py's accounting: a round's costs in plain steps, the steps that drafted nothing,
and what the timers predict, on hand-made rows whose answers are worked out below."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("speculative_bench", BENCHMARKS / "speculative.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))


def row(
    category: str,
    config: str,
    *,
    rounds: int,
    drafted: int,
    accepted: int,
    draft: float,
    verify: float,
    decode: float,
    generated: int,
) -> dict:
    """A prompt whose plain run took 10 steps of 10 ms."""
    gamma = max(drafted // max(rounds, 1), 1)
    return {
        "category": category,
        "config": config,
        "plain": {"steps": 10, "seconds": 0.1, "tokens": 10},
        "seconds": decode,
        "tokens": generated,
        "spec": {
            "draft_layers": None,
            "num_speculative_tokens": gamma,
            "drafter": config.split(":")[0],
            "rounds": rounds,
            "drafted": drafted,
            "accepted": accepted,
            "draft_seconds": draft,
            "verify_seconds": verify,
        },
        "identical": True,
        "ratio": (generated / decode) / 100.0,
    }


def test_round_costs_are_in_plain_steps_and_the_idle_steps_count_as_plain_ones(bench):
    # 4 rounds of γ 2: 8 drafted at 4 ms (c 0.4), verifications at 12 ms (v 1.2), 6 accepted -> 10 tokens;
    # 2 more tokens from steps that drafted nothing (10 ms each); 5 ms of other time: rest 0.5 steps / 4 rounds
    r = row("qa", "hybrid:2", rounds=4, drafted=8, accepted=6, draft=0.032, verify=0.048, decode=0.105, generated=12)
    (s,) = [s for s in bench.summarize([r], [bench.parse_config("hybrid:2")]) if s["category"] == "qa"]
    assert s["c"] == pytest.approx(0.4)
    assert s["verify_cost"] == pytest.approx(1.2)
    assert s["mean_gamma"] == pytest.approx(2.0)
    assert s["plain_steps"] == pytest.approx(2 / 6)
    assert s["rest"] == pytest.approx(0.5 / 4)
    # 12 tokens over 4 * (2 * 0.4 + 1.2) + 2 plain steps = 10 steps
    assert s["predicted_speedup"] == pytest.approx(1.2)
    assert s["tokens_per_round"] == pytest.approx(2.5)


def test_categories_pool_into_all(bench):
    a = row("qa", "int4:2", rounds=2, drafted=4, accepted=4, draft=0.02, verify=0.02, decode=0.04, generated=6)
    b = row("rag", "int4:2", rounds=2, drafted=4, accepted=0, draft=0.02, verify=0.02, decode=0.04, generated=2)
    out = {s["category"]: s for s in bench.summarize([a, b], [bench.parse_config("int4:2")])}
    assert set(out) == {"all", "qa", "rag"}
    assert out["all"]["acceptance"] == pytest.approx(0.5)
    assert out["all"]["prompts"] == 2
    assert out["rag"]["tokens_per_round"] == pytest.approx(1.0)


@pytest.mark.parametrize("text", ["hybrid", "int4:x", "nope:2", "exit:2", "int4:2:3:4"])
def test_a_bad_config_names_itself(bench, text):
    with pytest.raises(SystemExit, match="--configs"):
        bench.parse_config(text)


def test_policy_rows_kept_plain_count_as_plain_steps(bench):
    """`policy` rows: one speculated (2 rounds of γ 2, all kept), one the policy kept plain (no counters)."""
    on = row("qa", "policy", rounds=2, drafted=4, accepted=4, draft=0.016, verify=0.024, decode=0.05, generated=7)
    off = row("qa", "policy", rounds=0, drafted=0, accepted=0, draft=0.0, verify=0.0, decode=0.1, generated=10)
    off["spec"] = None
    assert bench.parse_config("policy") == "auto" and bench.label("auto") == "policy"
    (s,) = [s for s in bench.summarize([on, off], ["auto"]) if s["category"] == "all"]
    # 17 tokens: 6 from 2 rounds, 11 from steps that drafted nothing (1 + 10)
    assert s["plain_steps"] == pytest.approx(11 / 13)
    assert s["acceptance"] == pytest.approx(1.0)
    # timed: 2 * (2 * 0.4 + 1.2) + 11 = 15 steps for 17 tokens
    assert s["predicted_speedup"] == pytest.approx(17 / 15)
