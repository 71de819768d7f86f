"""Prompt processing (prefill) speed: selfspec's `model.prefill` per activation dtype side by side with
llama.cpp's prompt evaluation (llama-cpp-python, when installed) on the same GGUF, token ids and threads,
interleaved prompt by prompt in one run (the order rotates to cancel drift).

    python benchmarks/prefill.py [--dtypes float32,bfloat16] [--categories rag,summarization]
                                 [--prompts 4] [--repeats 3] [--threads 2] [--out benchmarks/results/prefill]

The prompts are the Spec-Bench dev questions of the given categories (the long ones: ~750-900 tokens
with the chat template), each prefilled from an empty cache. Prints and writes {out}.json/.md: median
prompt tokens/s per engine over the repeats, and each selfspec dtype's ratio against llama.cpp. The time
to first token of a long prompt is mostly this, and it is shared by plain and speculative decoding, so
it bounds their end-to-end ratio (a RAG answer of 128 tokens spends about a third of its plain time
here)."""

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

from selfspec import Engine  # noqa: E402
from selfspec.model.loader import default_gguf_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEV_SET = ROOT / "selfspec" / "data" / "spec_bench_dev.jsonl"


def questions(categories: list[str], per_category: int) -> list[str]:
    """The first `per_category` questions of each category, their first turns."""
    out: dict[str, list[str]] = {c: [] for c in categories}
    for line in DEV_SET.read_text().splitlines():
        q = json.loads(line)
        if q["category"] in out and len(out[q["category"]]) < per_category:
            out[q["category"]].append(q["turns"][0])
    return [text for texts in out.values() for text in texts]


def selfspec_runner(dtype: str):
    engine = Engine.from_pretrained("default", dtype=dtype)
    model, cache = engine.model, engine.cache

    @torch.inference_mode()
    def run(ids: list[int]) -> None:
        seq = cache.allocate()
        try:
            model.prefill(cache, seq, ids)
        finally:
            cache.free(seq)

    return engine, f"selfspec {dtype} ({model.kernels.backend})", run


def llama_cpp_runner(threads: int):
    """llama.cpp's prompt evaluation of the same ids (its default batch of 512), flash attention on."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(default_gguf_path()), n_threads=threads, n_ctx=2048, flash_attn=True, verbose=False)

    def run(ids: list[int]) -> None:
        llm.reset()
        llm.eval(ids)

    return "llama.cpp Q4_1 (flash attention)", run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--categories", default="rag,summarization")
    ap.add_argument("--prompts", type=int, default=4, help="per category")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "prefill")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runners, engine = {}, None
    for dtype in args.dtypes.split(","):
        engine, label, fn = selfspec_runner(dtype)
        runners[label] = fn
    llama = llama_cpp_runner(args.threads)
    if llama:
        runners[llama[0]] = llama[1]
    else:
        print("llama.cpp: not installed (pip install '.[bench]'), skipped")
    prompts = [engine.encode(text) for text in questions(args.categories.split(","), args.prompts)]
    tokens = sum(len(ids) for ids in prompts)
    for fn in runners.values():  # warm-up: kernel choice, first-touch of the caches
        fn(prompts[0])
    seconds: dict[str, list[float]] = {label: [] for label in runners}
    for r in range(args.repeats):
        total = dict.fromkeys(runners, 0.0)
        for i, ids in enumerate(prompts):
            labels = list(runners)
            shift = (r * len(prompts) + i) % len(labels)
            for label in labels[shift:] + labels[:shift]:
                start = time.perf_counter()
                runners[label](ids)
                total[label] += time.perf_counter() - start
        for label, s in total.items():
            seconds[label].append(s)
            print(f"repeat {r + 1}: {label}: {tokens / s:.0f} prompt tok/s")
    rate = {label: tokens / statistics.median(s) for label, s in seconds.items()}
    result = {
        "machine": describe(args.threads),
        "prompts": len(prompts),
        "prompt_tokens": tokens,
        "categories": args.categories.split(","),
        "repeats": args.repeats,
        "seconds": seconds,
        "prompt_tokens_per_second": rate,
        "llama_cpp": llama[0] if llama else None,
    }
    lines = [
        "# Prefill: prompt tokens/s",
        "",
        markdown(result["machine"]),
        "",
        f"{len(prompts)} Spec-Bench dev prompts ({', '.join(result['categories'])}; {tokens} tokens with the chat "
        f"template), each from an empty cache, interleaved, median of {args.repeats} repeats.",
        "",
        "| engine | prompt tok/s | vs llama.cpp |",
        "|---|---|---|",
    ]
    for label, value in rate.items():
        ratio = f"{value / rate[llama[0]]:.2f}x" if llama else "-"
        lines.append(f"| {label} | {value:.0f} | {ratio} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
