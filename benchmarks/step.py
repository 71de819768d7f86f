"""Where a decoding step's time goes: the linear layers versus everything else (norms, residuals, RoPE,
KV-cache writes, the paged gather, SDPA, building the pass's metadata, Python).

    python benchmarks/step.py [--configs float32:auto,float32:int4,bfloat16:auto,float32:float32:native] [--queries 1,5]
                              [--ops fused,eager] [--contexts 300] [--steps 40] [--repeats 5]
                              [--threads 2] [--out benchmarks/results/step]

A step is one forward of `k` query tokens after a `context`-token prompt plus the argmax a greedy decoder
reads (DecoderModel.greedy; the last row for k = 1, every row for a k-token verification), then a
rollback to the prompt's end; "every logit" is the same step computing all the logits instead (a sampled
step's head), timed alternately with it.
Attention's share grows with the context (a RAG prompt is ~1000 tokens).
"Rest" is timed with every linear replaced by a preallocated zero tensor of its output shape
(calibration.roofline.zero_linears, which `selfspec roofline` uses too), "linears" is the full step
minus the rest.
Full and stubbed steps alternate in blocks, repeated; medians are reported. `--ops`: the glue between
the linears, native.c's fused calls and/or the eager torch reference, on the same loaded model.
Writes {out}.json/.md."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe, save  # noqa: E402

from selfspec.calibration.roofline import zero_linears  # noqa: E402
from selfspec.model.loader import load  # noqa: E402
from selfspec.model.ops import Eager  # noqa: E402


def step_fn(model, k: int, context: int = 300):
    prompt = [100 + i % 30000 for i in range(context)]
    cache = model.new_cache(context + 64)
    seq = cache.allocate()
    model.prefill(cache, seq, prompt)
    tokens = torch.tensor([[5] * k])
    rows = slice(-1, None) if k == 1 else slice(None)

    def step(head=model.greedy) -> None:
        h = model.forward(tokens, cache, [seq])  # [1, k, hidden]
        head(h[:, rows])
        cache.truncate(seq, context)

    return step, lambda: step(model.logits)  # the greedy step, and one computing every logit


def per_step_ms(step, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - start) / n * 1e3


def measure(
    config: str, queries: list[int], ops: list[str], contexts: list[int], steps: int, repeats: int
) -> list[dict]:
    dtype, weights, *backend = config.split(":")  # dtype:weights[:backend]
    model = load("default", dtype, weights, backend[0] if backend else None).model
    glue = {"eager": Eager(model.config, model.rope), model.ops.name: model.ops}
    rows = []
    with torch.inference_mode():
        for name, n, k in ((name, n, k) for name in ops if name in glue for n in contexts for k in queries):
            model.ops = glue[name]
            step, every = step_fn(model, k, n)
            for _ in range(30):  # warm-up: the first forwards pay for the VM's page reclaim
                step()
            full, rest, logits = [], [], []
            for _ in range(repeats):
                full.append(per_step_ms(step, steps))
                logits.append(per_step_ms(every, steps))
                with zero_linears(model):
                    step()
                    rest.append(per_step_ms(step, steps))
                step()
            f, r = statistics.median(full), statistics.median(rest)
            rows.append(
                {"config": config, "backend": model.kernels.backend, "ops": name, "context": n, "queries": k}
                | {"step_ms": round(f, 2), "logits_step_ms": round(statistics.median(logits), 2)}
                | {"linears_ms": round(f - r, 2), "rest_ms": round(r, 2), "rest_runs_ms": [round(x, 2) for x in rest]}
            )
            print(
                f"{config:18s} {name:5s} context={n} k={k}  step {f:6.2f} ms = linears {f - r:6.2f} + rest {r:5.2f}"
                f" (every logit: {statistics.median(logits):6.2f})",
                flush=True,
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="float32:auto,float32:int4,bfloat16:auto")
    ap.add_argument("--queries", default="1,5")
    ap.add_argument("--ops", default="fused,eager")
    ap.add_argument("--contexts", default="300", help="prompt lengths before the step, comma-separated")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "step"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    queries = [int(q) for q in args.queries.split(",")]
    ops = args.ops.split(",")
    contexts = [int(n) for n in args.contexts.split(",")]
    rows = [r for c in args.configs.split(",") for r in measure(c, queries, ops, contexts, args.steps, args.repeats)]
    machine = describe(args.threads)
    lines = [
        "| config | backend | glue ops | context | queries | step ms | step ms, every logit | linears ms | rest ms |",
        "|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['config']} | {r['backend']} | {r['ops']} | {r['context']} | {r['queries']} | {r['step_ms']} "
            f"| {r['logits_step_ms']} | {r['linears_ms']} "
            f"| {r['rest_ms']} |"
            for r in rows
        ),
    ]
    save(args.out, {"machine": machine, "rows": rows}, lines)


if __name__ == "__main__":
    main()
