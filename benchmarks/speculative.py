"""Self-speculative vs plain decoding on the Spec-Bench dev set, per category and drafter, interleaved in
one run, with each round's costs measured where they arise (in situ).

    python benchmarks/speculative.py [--dtypes float32,bfloat16] [--weights auto]
                                     [--configs policy,hybrid:2,int4:4,lookup:3,exit:2:10]
                                     [--per-category 1] [--new-tokens 128] [--temperature 0] [--threads 2]

A configuration is `drafter:γ[:N]` (N: the draft's layers, which `exit` and `head` need), or `policy`:
what the engine's calibrated policy picks for each request by its category (steps it keeps plain count
as plain steps). Each prompt decodes plainly and with every configuration, the order reversed every
other prompt. Times are `generate`'s wall time less its prefill, so a step counts the Python around it
too. Per configuration
and category it reports the decoding speedup over plain (median over prompts), acceptance α (accepted /
drafted), tokens per round, and a round's costs in plain steps of the same prompts (a plain step: plain
decoding's time over its steps): c (a drafted token's draft time), v (a verification, with its
acceptance and rollback) and the rest of a round's time (whatever lies outside the round's two timers:
the engine's step, stats, detokenizing, streaming). Calibration times c and v in isolation (`selfspec
calibrate`); these are the same costs inside real rounds, whose drafts and verifications push each
other's weights out of the caches. Beside the measured speedup, what the two timers predict: the tokens
over the rounds' γ̄ c + v (γ̄ the mean tokens drafted a round) and a plain step for each step that
drafted nothing (the first, lookup without a match). Greedy runs count outputs identical to plain and
give the plain model's top-2 logit gap at each first divergence (a near-tie shows as a gap of a few
bf16 ulps).
Writes {--out}.json and .md (default benchmarks/results/speculative)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import dev_prompts  # noqa: E402
from machine import describe, save  # noqa: E402

from selfspec import Engine, SamplingParams, SpecConfig  # noqa: E402
from selfspec.decoding.engine import SpecStats  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def parse_config(text: str) -> SpecConfig | str:
    """`drafter:γ[:N]` -> SpecConfig, `policy` -> "auto" (the engine's calibrated policy per request); a
    clear error for anything else."""
    if text == "policy":
        return "auto"
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError("use drafter:gamma or drafter:gamma:N")
        layers = int(parts[2]) if len(parts) == 3 else None
        return SpecConfig(layers, int(parts[1]), parts[0])
    except ValueError as e:
        raise SystemExit(f"--configs: {text!r} is invalid ({e}), e.g. hybrid:2, exit:2:10 or policy") from None


def label(spec: SpecConfig | str) -> str:
    if isinstance(spec, str):
        return "policy"
    n = f":{spec.draft_layers}" if spec.draft_layers is not None else ""
    return f"{spec.drafter}:{spec.num_speculative_tokens}{n}"


@torch.inference_mode()
def top2_gap(engine: Engine, prompt_ids: list[int], prefix: list[int]) -> float:
    """The plain model's top-1 minus top-2 logit after prompt + prefix (a single-token last step)."""
    req = engine.add_request(prompt_ids + prefix, SamplingParams(temperature=0, max_tokens=1))
    try:
        engine.prefill(req)
        h = engine.model.forward(torch.tensor([[req.last_token]]), engine.cache, [req.kv])
        top = engine.model.logits(h[0, -1]).topk(2).values
        return float(top[0] - top[1])
    finally:
        engine.release(req)


def run_dtype(
    dtype: str, weights: str, questions: list[dict], configs: list[SpecConfig | str], params: SamplingParams
) -> dict:
    engine = Engine.from_pretrained("default", dtype=dtype, weights=weights)
    runs = [("plain", None)] + [(label(s), s) for s in configs]
    for _, spec in runs:  # warm-up, which also loads each drafter (the first int4 draft builds its copy)
        engine.generate("Hello", SamplingParams(temperature=0, max_tokens=8), speculation=spec)
    rows = []
    for i, q in enumerate(questions):
        ids = engine.encode(q["turns"][0])
        results = {}
        for name, spec in runs if i % 2 == 0 else runs[::-1]:  # alternate the order to cancel drift
            start = time.perf_counter()
            r = engine.generate(ids, params, speculation=spec, category=q["category"])  # the policy's bucket
            results[name] = r, time.perf_counter() - start - r.stats.prefill_seconds
        plain, plain_seconds = results["plain"]
        for name, spec in runs[1:]:
            r, seconds = results[name]
            first_diff = next((j for j, (a, b) in enumerate(zip(r.token_ids, plain.token_ids)) if a != b), None)
            row = {
                "question_id": q["question_id"],
                "category": q["category"],
                "config": name,
                "plain": {"steps": plain.stats.steps, "seconds": plain_seconds, "tokens": plain.stats.generated_tokens},
                "seconds": seconds,  # generate's wall time less the prefill: decoding and all around it
                "tokens": r.stats.generated_tokens,
                "spec": r.stats.spec.to_dict() if r.stats.spec else None,  # None: the policy kept it plain
                "identical": r.token_ids == plain.token_ids,
                "first_divergence": first_diff,
            }
            if params.greedy and first_diff is not None:
                row["plain_top2_gap_at_divergence"] = top2_gap(engine, ids, plain.token_ids[:first_diff])
            row["ratio"] = _rate(row) / _rate(row["plain"])
            rows.append(row)
            s = r.stats.spec
            counts = f"alpha {s.acceptance_rate:.2f}  tok/round {s.mean_tokens_per_round:.2f}" if s else "plain"
            same = "identical" if row["identical"] else f"diverges at {first_diff}"
            print(f"{dtype:9s} {q['category']:15s} {name:10s} ratio {row['ratio']:.2f}  {counts}  {same}", flush=True)
    return {"dtype": dtype, "weights": weights, "rows": rows, "summary": summarize(rows, configs)}


def _rate(d: dict) -> float:
    return d["tokens"] / d["seconds"]


def summarize(rows: list[dict], configs: list[SpecConfig | str]) -> list[dict]:
    out = []
    for spec in configs:
        mine = [r for r in rows if r["config"] == label(spec)]
        for category in ["all"] + sorted({r["category"] for r in mine}):
            sel = [r for r in mine if category in ("all", r["category"])]
            pooled = SpecStats(None, 1, label(spec))  # the counters only (the policy's rows differ in γ)
            for r in sel:
                if r["spec"] is not None:
                    pooled = pooled.merge(_stats(r["spec"]))
            step = sum(r["plain"]["seconds"] for r in sel) / sum(r["plain"]["steps"] for r in sel)
            rounds = max(pooled.rounds, 1)
            c = pooled.draft_seconds / max(pooled.drafted, 1) / step
            v = pooled.verify_seconds / rounds / step
            gamma = pooled.drafted / rounds
            # steps that drafted nothing (the first, lookup without a match) emit one token each, as a plain
            # step does at about a plain step's time
            tokens = sum(r["tokens"] for r in sel)
            idle = tokens - pooled.rounds - pooled.accepted
            spent = sum(r["seconds"] for r in sel) / step  # all of it, in plain steps
            timed = pooled.rounds * (gamma * c + v) + idle
            out.append(
                {
                    "config": label(spec),
                    "category": category,
                    "prompts": len(sel),
                    "median_ratio": statistics.median(r["ratio"] for r in sel),
                    "acceptance": pooled.acceptance_rate,
                    "tokens_per_round": pooled.mean_tokens_per_round,
                    "mean_gamma": gamma,
                    "c": c,
                    "verify_cost": v,
                    "plain_steps": idle / max(idle + pooled.rounds, 1),
                    "rest": (spent - timed) / rounds,
                    "predicted_speedup": tokens / timed if timed else 0.0,
                    "identical": sum(r["identical"] for r in sel),
                }
            )
    return out


def _stats(d: dict) -> SpecStats:
    keys = SpecStats.__dataclass_fields__
    return SpecStats(**{k: v for k, v in d.items() if k in keys})


def write_results(out: Path, result: dict) -> None:
    """{out}.json and {out}.md (machine.save)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Self-speculative vs plain decoding (Spec-Bench dev), costs in situ",
        "",
        f"Default model (SmolLM2-135M-Instruct), temperature {result['temperature']}, {result['new_tokens']} new "
        f"tokens, EOS ignored, {result['per_category']} prompt(s) per category; plain and speculative runs "
        "interleaved prompt by prompt; times are generate's wall time less the prefill. Speedup: decoding "
        "tokens/s over plain's (median over prompts). α = accepted / drafted; γ̄ = tokens drafted a round; c, v "
        "and rest in plain steps (plain decoding's time over its steps, Python around the forward included): a "
        "drafted token's draft time, a verification (with acceptance and rollback), the rest of a round's time "
        "(outside those two timers); plain steps: the share of steps that drafted nothing (the first, lookup "
        "without a match), counted as a plain step each; timed = all tokens over the rounds' γ̄ c + v and "
        "those steps, what the two timers predict.",
    ]
    for r in result["dtypes"]:
        lines += [
            "",
            f"## {r['dtype']} activations, {r['weights']} weights",
            "",
            "| config | category | prompts | speedup | α | tokens/round | γ̄ | plain steps | c | v | rest | timed "
            "| identical |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for s in r["summary"]:
            lines.append(
                f"| {s['config']} | {s['category']} | {s['prompts']} | {s['median_ratio']:.2f}x | "
                f"{s['acceptance']:.3f} | {s['tokens_per_round']:.2f} | {s['mean_gamma']:.2f} | "
                f"{s['plain_steps']:.0%} | {s['c']:.2f} | {s['verify_cost']:.2f} | {s['rest']:.2f} | "
                f"{s['predicted_speedup']:.2f}x | "
                f"{s['identical']}/{s['prompts']} |"
            )
        gaps = [row for row in r["rows"] if "plain_top2_gap_at_divergence" in row]
        if gaps:
            lines += [
                "",
                "First divergences from plain greedy output, with the plain model's top-2 logit gap there:",
                "",
            ]
            lines += [
                f"- q{g['question_id']} ({g['category']}, {g['config']}): token {g['first_divergence']}, "
                f"gap {g['plain_top2_gap_at_divergence']:.4f}"
                for g in gaps
            ]
    save(out, result, lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--weights", default="auto", choices=["auto", "float32", "bfloat16", "int8", "int4"])
    ap.add_argument(
        "--configs", default="policy,hybrid:2,int4:4,lookup:3", help="comma-separated drafter:gamma[:N] or policy"
    )
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "speculative")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    configs = [parse_config(c) for c in args.configs.split(",")]
    questions = dev_prompts(13 * args.per_category)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.new_tokens, ignore_eos=True, seed=0)
    result = {
        "benchmark": "speculative",
        "machine": describe(args.threads),
        "temperature": args.temperature,
        "new_tokens": args.new_tokens,
        "per_category": args.per_category,
        "dtypes": [run_dtype(d, args.weights, questions, configs, params) for d in args.dtypes.split(",")],
    }
    write_results(args.out, result)
    for r in result["dtypes"]:
        for s in r["summary"]:
            if s["category"] == "all":
                print(
                    f"{r['dtype']} {s['config']}: {s['median_ratio']:.2f}x plain (timed parts predict "
                    f"{s['predicted_speedup']:.2f}x), alpha {s['acceptance']:.3f}, {s['tokens_per_round']:.2f} tokens "
                    f"a round, c {s['c']:.2f}, v {s['verify_cost']:.2f}, rest {s['rest']:.2f} steps, identical "
                    f"{s['identical']}/{s['prompts']}"
                )


if __name__ == "__main__":
    main()
