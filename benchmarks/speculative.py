"""Self-speculative vs plain decoding on the Spec-Bench dev set, per category, interleaved in one run.

    python benchmarks/speculative.py [--dtypes float32,bfloat16] [--configs 8:1,15:2,24:2]
                                     [--per-category 1] [--new-tokens 128] [--temperature 0] [--threads 2]

For each (draft layers N, γ) it reports per category the measured tokens/s ratio against plain
decoding, acceptance α (accepted / drafted), tokens per round, the measured draft cost ratio c, and
the analytic speedup E / (γc + 1) with E = (1 - α^(γ+1)) / (1 - α) beside the measurement. Greedy runs
also report how often speculative output differs from plain output, and the top-2 logit gap of the
plain model at each first divergence (a near-tie shows as a gap of a few bf16 ulps).
Writes benchmarks/results/speculative.{json,md}."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import dev_prompts  # noqa: E402
from machine import describe, markdown  # noqa: E402

from selfspec import Engine, SamplingParams, SpecConfig  # noqa: E402
from selfspec.calibration.speedup import estimate  # noqa: E402
from selfspec.decoding.engine import SpecStats  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def predicted_speedup(alpha: float, gamma: int, c: float, verify_cost: float = 1.0) -> float:
    """E / (γc + v): the brief's model with v = 1 (verification costs one full forward); self-speculation
    verifies with layers [N, L) only, so the measured v is the better denominator."""
    return estimate(alpha, gamma, c, verify_cost or 1.0).speedup


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


def run_dtype(dtype: str, questions: list[dict], configs: list[SpecConfig], params: SamplingParams) -> dict:
    engine = Engine.from_pretrained("default", dtype=dtype)
    engine.generate("Hello", SamplingParams(temperature=0, max_tokens=8))  # warm-up
    rows = []
    for i, q in enumerate(questions):
        ids = engine.encode(q["turns"][0])
        runs = [("plain", None)] + [(f"N={s.draft_layers},g={s.num_speculative_tokens}", s) for s in configs]
        results = {}
        for name, spec in runs if i % 2 == 0 else runs[::-1]:  # alternate the order to cancel drift
            start = time.perf_counter()
            r = engine.generate(ids, params, speculation=spec)
            results[name] = (r, time.perf_counter() - start)
        plain, plain_time = results["plain"]
        for name, spec in runs[1:]:
            r, t = results[name]
            first_diff = next((j for j, (a, b) in enumerate(zip(r.token_ids, plain.token_ids)) if a != b), None)
            row = {
                "question_id": q["question_id"],
                "category": q["category"],
                "config": name,
                "draft_layers": spec.draft_layers,
                "gamma": spec.num_speculative_tokens,
                "plain_tok_s": len(plain.token_ids) / plain_time,
                "spec_tok_s": len(r.token_ids) / t,
                "spec": r.stats.spec.to_dict(),
                "identical": r.token_ids == plain.token_ids,
                "first_divergence": first_diff,
            }
            if params.greedy and first_diff is not None:
                row["plain_top2_gap_at_divergence"] = top2_gap(engine, ids, plain.token_ids[:first_diff])
            row["ratio"] = row["spec_tok_s"] / row["plain_tok_s"]
            rows.append(row)
            s = r.stats.spec
            print(
                f"{dtype:9s} {q['category']:15s} {name:10s} plain {row['plain_tok_s']:5.1f} tok/s  "
                f"spec {row['spec_tok_s']:5.1f} "
                f"ratio {row['ratio']:.2f}  alpha {s.acceptance_rate:.2f}  tok/round {s.mean_tokens_per_round:.2f}  "
                f"c {s.draft_cost_ratio:.2f}  {'identical' if row['identical'] else f'diverges at {first_diff}'}",
                flush=True,
            )
    return {"dtype": dtype, "rows": rows, "summary": summarize(rows, configs)}


def summarize(rows: list[dict], configs: list[SpecConfig]) -> list[dict]:
    out = []
    for spec in configs:
        mine = [r for r in rows if r["draft_layers"] == spec.draft_layers and r["gamma"] == spec.num_speculative_tokens]
        for category in ["all"] + sorted({r["category"] for r in mine}):
            sel = [r for r in mine if category in ("all", r["category"])]
            pooled = SpecStats(spec.draft_layers, spec.num_speculative_tokens)
            for r in sel:
                pooled = pooled.merge(_stats(r["spec"]))
            alpha, c = pooled.acceptance_rate, pooled.draft_cost_ratio
            out.append(
                {
                    "draft_layers": spec.draft_layers,
                    "gamma": spec.num_speculative_tokens,
                    "category": category,
                    "prompts": len(sel),
                    "median_ratio": statistics.median(r["ratio"] for r in sel),
                    "acceptance": alpha,
                    "tokens_per_round": pooled.mean_tokens_per_round,
                    "c": c,
                    "verify_cost": pooled.verify_cost_ratio,
                    "predicted_speedup": predicted_speedup(alpha, spec.num_speculative_tokens, c),
                    "predicted_speedup_measured_verify": predicted_speedup(
                        alpha, spec.num_speculative_tokens, c, pooled.verify_cost_ratio
                    ),
                    "identical": sum(r["identical"] for r in sel),
                }
            )
    return out


def _stats(d: dict) -> SpecStats:
    keys = SpecStats.__dataclass_fields__
    return SpecStats(**{k: v for k, v in d.items() if k in keys})


def write_results(out_dir: Path, result: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "speculative.json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Self-speculative vs plain decoding (Spec-Bench dev)",
        "",
        markdown(result["machine"]),
        f"Default model (SmolLM2-135M-Instruct, 30 layers, untrained early exits), temperature "
        f"{result['temperature']}, {result['new_tokens']} new tokens, EOS ignored, {result['per_category']} "
        "prompt(s) per category; plain and speculative runs interleaved prompt by prompt. Ratio = speculative "
        "tokens/s over plain tokens/s (median over prompts); α = accepted / drafted; c = one draft step over "
        "one plain step, both measured; v = one verification over one plain step; predicted = E / (γc + 1) "
        "(the brief's model), and E / (γc + v) with the measured v (verification runs only layers [N, L)).",
    ]
    for r in result["dtypes"]:
        lines += [
            "",
            f"## {r['dtype']}",
            "",
            "| N | γ | category | prompts | measured ratio | α | tokens/round | c | v | "
            "predicted E/(γc+1) | predicted E/(γc+v) | identical to plain |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for s in r["summary"]:
            lines.append(
                f"| {s['draft_layers']} | {s['gamma']} | {s['category']} | {s['prompts']} | {s['median_ratio']:.2f} | "
                f"{s['acceptance']:.3f} | {s['tokens_per_round']:.2f} | {s['c']:.2f} | {s['verify_cost']:.2f} | "
                f"{s['predicted_speedup']:.2f} | {s['predicted_speedup_measured_verify']:.2f} | "
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
    (out_dir / "speculative.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--configs", default="8:1,15:2,24:2", help="comma-separated N:gamma pairs")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    configs = [SpecConfig(*map(int, c.split(":"))) for c in args.configs.split(",")]
    categories = 13
    questions = dev_prompts(categories * args.per_category)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.new_tokens, ignore_eos=True, seed=0)
    result = {
        "benchmark": "speculative",
        "machine": describe(args.threads),
        "temperature": args.temperature,
        "new_tokens": args.new_tokens,
        "per_category": args.per_category,
        "dtypes": [run_dtype(d, questions, configs, params) for d in args.dtypes.split(",")],
    }
    write_results(args.out, result)
    for r in result["dtypes"]:
        for s in r["summary"]:
            if s["category"] == "all":
                print(
                    f"{r['dtype']} N={s['draft_layers']} gamma={s['gamma']}: measured {s['median_ratio']:.2f}x, "
                    f"predicted {s['predicted_speedup']:.2f}x (v=1) / {s['predicted_speedup_measured_verify']:.2f}x "
                    f"(v={s['verify_cost']:.2f}), alpha {s['acceptance']:.3f}, c {s['c']:.2f}, "
                    f"identical {s['identical']}/{s['prompts']}"
                )


if __name__ == "__main__":
    main()
