"""Plain decoding speed: selfspec's weight formats and kernels side by side with transformers generate()
and llama.cpp (llama-cpp-python, when installed) on the same model, prompts and threads, interleaved
prompt by prompt in one run (the order rotates to cancel drift).

    python benchmarks/decode.py [--configs float32:float32:dense,float32:auto,float32:int4,...]
                                [--prompts 8] [--new-tokens 128] [--threads 2] [--repeats 2]

A config is dtype:weights[:backend] (activations, weight format, a forced float backend; `dense` is
the reference path that every release before the kernel backends ran). Prints per-prompt tokens/s and
writes benchmarks/results/decode.{json,md}, with ratios against llama.cpp, transformers and dense."""

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
from selfspec.model.loader import default_gguf_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEV_SET = ROOT / "selfspec" / "data" / "spec_bench_dev.jsonl"
CONFIGS = "float32:float32:dense,float32:auto,float32:int4,bfloat16:bfloat16:dense,bfloat16:auto,bfloat16:int4"


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


def selfspec_runner(config: str, new_tokens: int):
    dtype, weights, *backend = config.split(":")
    engine = Engine.from_pretrained("default", dtype=dtype, weights=weights, backend=backend[0] if backend else None)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    k = engine.model.kernels
    label = f"selfspec {dtype} act, {k.weights} weights, {k.backend}"
    return engine, label, lambda ids: engine.generate(ids, params, speculation=None).token_ids


def transformers_runner(ckpt: str, dtype: str, new_tokens: int):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype)).eval()
    hf.generation_config.eos_token_id = None  # every engine generates exactly new_tokens
    hf.generation_config.pad_token_id = 0

    def run(ids):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
        return out[0, len(ids) :].tolist()

    return f"transformers {dtype}", run


def llama_cpp_runner(threads: int, new_tokens: int):
    """llama.cpp on the same GGUF (its own 4-bit kernels), flash attention on, greedy, EOS ignored."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(default_gguf_path()), n_threads=threads, n_ctx=2048, flash_attn=True, verbose=False)

    def run(ids):
        out = []
        llm.reset()  # generate(reset=True) alone reuses the cached prefix of a repeated prompt
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(token)
            if len(out) == new_tokens:
                break
        return out

    return "llama.cpp Q4_1 (flash attention)", run


def bench(configs: list[str], prompts: list[dict], new_tokens: int, repeats: int, threads: int) -> dict:
    runners, engine = {}, None
    for config in configs:
        engine, label, fn = selfspec_runner(config, new_tokens)
        runners[label] = fn
    ckpt = str(engine.checkpoint_dir)
    for dtype in dict.fromkeys(c.split(":")[0] for c in configs):
        label, fn = transformers_runner(ckpt, dtype, new_tokens)
        runners[label] = fn
    llama = llama_cpp_runner(threads, new_tokens)
    if llama:
        runners[llama[0]] = llama[1]
    else:
        print("llama-cpp-python not installed: llama.cpp skipped (pip install '.[bench]')", flush=True)
    warm = engine.encode("Hello")
    for fn in runners.values():
        fn(warm)
    names = list(runners)
    rows = []
    for i, q in enumerate(prompts):
        ids = engine.encode(q["turns"][0])
        times, outputs = {n: [] for n in names}, {}
        for r in range(repeats):
            shift = (i + r) % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(timed(lambda: outputs.__setitem__(name, runners[name](ids))))
        row = {
            "question_id": q["question_id"],
            "category": q["category"],
            "prompt_tokens": len(ids),
            "tok_s": {n: new_tokens / statistics.median(t) for n, t in times.items()},
            "identical_to_first": {n: _common_prefix(outputs[n], outputs[names[0]]) for n in names},
        }
        rows.append(row)
        print(
            f"{q['category']:15s} prompt {len(ids):4d}  " + "  ".join(f"{n}: {v:.1f}" for n, v in row["tok_s"].items()),
            flush=True,
        )
    medians = {n: statistics.median(r["tok_s"][n] for r in rows) for n in names}
    return {"names": names, "rows": rows, "median_tok_s": medians, "llama_cpp": llama[0] if llama else None}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def write_results(out_dir: Path, result: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "decode.json").write_text(json.dumps(result, indent=2))
    med, names, llama = result["median_tok_s"], result["names"], result["llama_cpp"]
    lines = [
        "# Plain decoding: selfspec's weight formats and kernels vs transformers and llama.cpp",
        "",
        markdown(result["machine"]),
        f"Default model (SmolLM2-135M-Instruct, Q4_1 GGUF), greedy, {result['new_tokens']} new tokens, EOS "
        f"ignored, timed end to end (prefill included), every engine interleaved prompt by prompt, median "
        f"of {result['repeats']} runs each, then the median over {len(result['rows'])} prompts.",
        "",
        "| engine | tok/s (median) | vs dense, same dtype | vs transformers, same dtype | vs llama.cpp |",
        "|---|---|---|---|---|",
    ]
    for n in names:
        dtype = "bfloat16" if "bfloat16" in n else "float32"
        dense = next((m for m in names if m.startswith(f"selfspec {dtype} act") and m.endswith("dense")), None)
        hf = f"transformers {dtype}"
        cells = [f"{med[n] / med[ref]:.2f}x" if ref in med and n.startswith("selfspec") else "" for ref in (dense, hf)]
        cells.append(f"{med[n] / med[llama]:.2f}x" if llama and n != llama else "")
        lines.append(f"| {n} | {med[n]:.1f} | " + " | ".join(cells) + " |")
    if not llama:
        lines += ["", "llama.cpp was not installed for this run (`pip install '.[bench]'`)."]
    lines += ["", "## Per prompt (tokens/s; identical greedy tokens vs the first engine)", ""]
    lines.append("| question | category | prompt | " + " | ".join(names) + " |")
    lines.append("|---|---|---|" + "---|" * len(names))
    for row in result["rows"]:
        cells = [f"{row['tok_s'][n]:.1f} ({row['identical_to_first'][n]})" for n in names]
        lines.append(
            f"| {row['question_id']} | {row['category']} | {row['prompt_tokens']} | " + " | ".join(cells) + " |"
        )
    (out_dir / "decode.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=CONFIGS, help="dtype:weights[:backend], comma-separated")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="timings per prompt and engine (median kept)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = dev_prompts(args.prompts)
    result = bench(args.configs.split(","), prompts, args.new_tokens, args.repeats, args.threads)
    result.update(benchmark="decode", machine=describe(args.threads), new_tokens=args.new_tokens, repeats=args.repeats)
    for n, v in result["median_tok_s"].items():
        print(f"{n}: {v:.1f} tok/s")
    write_results(args.out, result)


if __name__ == "__main__":
    main()
