"""How fast a prefill chunk's attention can run on this machine: the default model's attention shape
(9 query heads, 3 KV heads, head_dim 64) for a chunk of n queries at depth d, by each formulation
that keeps one masked call's meaning:

- sdpa: what `paged_attention` runs for a prefill chunk (SDPA, bool mask, enable_gqa);
- sdpa-float-mask: the same with an additive float mask and K/V repeated per query head;
- folded: query heads folded into the rows of their KV head (no GQA expansion);
- split: the cached past without a mask plus the chunk's own causal block, merged by log-sum-exp
  (torch's CPU flash kernel returns it);
- bmm: hand-written scores, softmax and weighted sum.

    python benchmarks/attention.py [--depths 1000,4000,7000] [--queries 32,64,128] [--threads 2]

Medians of `--repeats` timings per cell; writes benchmarks/results/attention.{json,md}. This is what
bounds a stream's gap while a long prompt is chunked in (benchmarks/faults.py)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine import describe, markdown  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
GROUP = HEADS // KV_HEADS


def formulations(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, depth: int) -> dict:
    """q [1, heads, n, dim] at positions depth..depth+n-1, k/v [1, kv_heads, depth + n, dim]."""
    n, t = q.shape[2], k.shape[2]
    allowed = torch.arange(t)[None, :] <= torch.arange(depth, depth + n)[:, None]  # [n, T]
    bias = torch.zeros(n, t).masked_fill_(~allowed, float("-inf"))
    k_rep, v_rep = k.repeat_interleave(GROUP, 1), v.repeat_interleave(GROUP, 1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def split() -> torch.Tensor:
        past, lse_past = flash(q, k_rep[:, :, :depth], v_rep[:, :, :depth])
        own, lse_own = flash(q, k_rep[:, :, depth:], v_rep[:, :, depth:], is_causal=True)
        top = torch.maximum(lse_past, lse_own)
        w_past, w_own = (lse_past - top).exp()[..., None], (lse_own - top).exp()[..., None]
        return (past * w_past + own * w_own) / (w_past + w_own)

    def bmm() -> torch.Tensor:
        rows = q.view(KV_HEADS, GROUP * n, HEAD_DIM)
        scores = torch.baddbmm(bias.repeat(GROUP, 1), rows, k[0].transpose(1, 2), alpha=HEAD_DIM**-0.5)
        return torch.bmm(torch.softmax(scores, -1), v[0]).view(1, HEADS, n, HEAD_DIM)

    return {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True),
        "sdpa-float-mask": lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=bias),
        "folded": lambda: F.scaled_dot_product_attention(
            q.view(1, KV_HEADS, GROUP * n, HEAD_DIM), k, v, attn_mask=allowed.repeat(GROUP, 1)
        ).view(1, HEADS, n, HEAD_DIM),
        "split": split,
        "bmm": bmm,
    }


def seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="1000,4000,7000")
    ap.add_argument("--queries", default="32,64,128")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results" / "attention"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    with torch.inference_mode():
        for depth in (int(d) for d in args.depths.split(",")):
            for n in (int(x) for x in args.queries.split(",")):
                q = torch.randn(1, HEADS, n, HEAD_DIM)
                k, v = torch.randn(2, 1, KV_HEADS, depth + n, HEAD_DIM)
                fns = formulations(q, k, v, depth)
                ref = fns["sdpa"]()
                flops = 4 * HEADS * n * (depth + n) * HEAD_DIM  # scores and weighted sum, masked keys included
                for name, fn in fns.items():
                    s = seconds(fn, args.repeats)
                    err = (fn() - ref).abs().max().item()
                    rows.append({"depth": depth, "queries": n, "method": name, "ms": round(s * 1e3, 3)})
                    rows[-1] |= {"gflops": round(flops / s / 1e9, 1), "max_abs_diff_vs_sdpa": err}
                    print(
                        f"depth {depth:5d} queries {n:4d} {name:16s} {s * 1e3:7.2f} ms {flops / s / 1e9:6.1f} GFLOP/s"
                    )
    machine = describe(args.threads)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cells = {(r["depth"], r["queries"], r["method"]): r for r in rows}
    lines = [
        "# A prefill chunk's attention: ms per layer (GFLOP/s)",
        "",
        markdown(machine),
        "",
        "| depth | queries | " + " | ".join(methods) + " |",
        "|---|---|" + "---|" * len(methods),
    ]
    for depth, n in dict.fromkeys((r["depth"], r["queries"]) for r in rows):
        got = [cells[depth, n, m] for m in methods]
        lines.append(f"| {depth} | {n} | " + " | ".join(f"{c['ms']:.2f} ({c['gflops']:.0f})" for c in got) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
