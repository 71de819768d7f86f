"""Plain decoding speed: selfspec vs transformers generate() on the same model, prompts, dtype and
threads, interleaved prompt by prompt in one run (the order alternates to cancel drift).

    python benchmarks/decode.py [--dtypes float32,bfloat16] [--prompts 8] [--new-tokens 128] [--threads 2]
                                [--repeats 2]

Prints per-prompt tokens/s and ratios, and writes benchmarks/results/decode.{json,md}."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe, markdown  # noqa: E402

from selfspec import Engine, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEV_SET = ROOT / "selfspec" / "data" / "spec_bench_dev.jsonl"


def dev_prompts(n: int) -> list[dict]:
    """The first question of each category in turn, until n prompts."""
    by_cat: dict[str, list[dict]] = {}
    for line in DEV_SET.read_text().splitlines():
        q = json.loads(line)
        by_cat.setdefault(q["category"], []).append(q)
    out, i = [], 0
    while len(out) < n:
        for qs in by_cat.values():
            if i < len(qs) and len(out) < n:
                out.append(qs[i])
        i += 1
    return out


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_dtype(dtype: str, prompts: list[dict], new_tokens: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    engine = Engine.from_pretrained("default", dtype=dtype)
    ckpt = str(engine.checkpoint_dir)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype)).eval()
    hf.generation_config.eos_token_id = None  # both sides generate exactly new_tokens
    hf.generation_config.pad_token_id = 0
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)

    def ours(ids):
        return engine.generate(ids, params).token_ids

    def theirs(ids):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
        return out[0, len(ids) :].tolist()

    warm = engine.encode("Hello")
    ours(warm), theirs(warm)
    rows = []
    for i, q in enumerate(prompts):
        ids = engine.encode(q["turns"][0])
        order = [("selfspec", ours), ("transformers", theirs)]
        times, outputs = {"selfspec": [], "transformers": []}, {}
        for r in range(repeats):
            for name, fn in order if (i + r) % 2 == 0 else order[::-1]:
                times[name].append(timed(lambda: outputs.__setitem__(name, fn(ids))))
        times = {name: statistics.median(t) for name, t in times.items()}
        row = {
            "question_id": q["question_id"],
            "category": q["category"],
            "prompt_tokens": len(ids),
            "selfspec_tok_s": new_tokens / times["selfspec"],
            "transformers_tok_s": new_tokens / times["transformers"],
            "identical_prefix": _common_prefix(outputs["selfspec"], outputs["transformers"]),
        }
        row["ratio"] = row["selfspec_tok_s"] / row["transformers_tok_s"]
        rows.append(row)
        print(
            f"{dtype:9s} {q['category']:15s} prompt {len(ids):4d}  selfspec {row['selfspec_tok_s']:6.1f} tok/s  "
            f"transformers {row['transformers_tok_s']:6.1f} tok/s  ratio {row['ratio']:.2f}  "
            f"identical tokens {row['identical_prefix']}/{new_tokens}",
            flush=True,
        )
    return {
        "dtype": dtype,
        "rows": rows,
        "median_ratio": statistics.median(r["ratio"] for r in rows),
        "median_selfspec_tok_s": statistics.median(r["selfspec_tok_s"] for r in rows),
        "median_transformers_tok_s": statistics.median(r["transformers_tok_s"] for r in rows),
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def write_results(out_dir: Path, result: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "decode.json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Plain decoding: selfspec vs transformers generate()",
        "",
        markdown(result["machine"]),
        f"Default model (SmolLM2-135M-Instruct), greedy, {result['new_tokens']} new tokens, EOS ignored, "
        f"timed end to end (prefill included), the two engines interleaved prompt by prompt, median of "
        f"{result['repeats']} runs each.",
        "",
        "| dtype | selfspec tok/s (median) | transformers tok/s (median) | median ratio |",
        "|---|---|---|---|",
    ]
    for r in result["dtypes"]:
        lines.append(
            f"| {r['dtype']} | {r['median_selfspec_tok_s']:.1f} | {r['median_transformers_tok_s']:.1f} | "
            f"**{r['median_ratio']:.2f}x** |"
        )
    for r in result["dtypes"]:
        lines += [
            "",
            f"## {r['dtype']}",
            "",
            "| question | category | prompt tokens | selfspec | transformers | ratio | identical tokens |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in r["rows"]:
            lines.append(
                f"| {row['question_id']} | {row['category']} | {row['prompt_tokens']} | "
                f"{row['selfspec_tok_s']:.1f} | "
                f"{row['transformers_tok_s']:.1f} | {row['ratio']:.2f} | "
                f"{row['identical_prefix']}/{result['new_tokens']} |"
            )
    (out_dir / "decode.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="timings per prompt and engine (median kept)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = dev_prompts(args.prompts)
    result = {
        "benchmark": "decode",
        "machine": describe(args.threads),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "dtypes": [bench_dtype(d, prompts, args.new_tokens, args.repeats) for d in args.dtypes.split(",")],
    }
    for r in result["dtypes"]:
        print(f"{r['dtype']}: median selfspec/transformers = {r['median_ratio']:.2f}x")
    write_results(args.out, result)


if __name__ == "__main__":
    main()
