"""`selfspec roofline`: memory bandwidth, the decode step's lower bound, the measured step, and the
cost of verifying k tokens at once."""

from __future__ import annotations

import json

from .common import ArgumentParser, add_model_args, cpu_only, positive_int, run

PROG = "selfspec roofline"


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Are we memory-bound? Step lower bound = weight bytes / read bandwidth.")
    add_model_args(p)
    p.add_argument("--context", type=positive_int, default=128, help="tokens already in the cache (default 128)")
    p.add_argument("--max-k", type=positive_int, default=16, help="largest k of the k-token forward curve")
    p.add_argument("--compare", help="more weight formats to measure side by side, e.g. float32,int8,int4")
    p.add_argument("--out", help="also write <out>.json and <out>.md (with the machine described)")
    p.add_argument("--json", action="store_true")
    return p


def _body(args) -> int:
    from selfspec.calibration.roofline import measure
    from selfspec.model.loader import load

    cpu_only(args, PROG, "it measures this CPU's memory bandwidth; benchmarks/gpu_smoke.py measures a GPU")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    formats = list(dict.fromkeys([args.weights] + [w for w in (args.compare or "").split(",") if w]))
    results = {}
    for weights in formats:  # one model at a time: the memory of one is freed before the next loads
        r = measure(load(args.model, args.dtype, weights).model, context=args.context, max_k=args.max_k)
        results[r.weights] = r  # keyed by the format that ran (auto resolves to one)
    text = "\n\n".join(_report(r, args.dtype) for r in results.values())
    data = {w: r.to_dict() for w, r in results.items()}
    if args.out:
        from pathlib import Path

        from selfspec.calibration.calibrate import machine_info

        m = machine_info()
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"model": args.model, "dtype": args.dtype, "machine": m, "weights": data}
        out.with_suffix(".json").write_text(json.dumps(payload, indent=1))
        header = (
            f"# Roofline: {args.model}, {args.dtype} activations\n\n"
            f"Machine: {m['platform']}, {m['cores']} cores, {m['torch_threads']} torch threads, torch {m['torch']}.\n\n"
        )
        out.with_suffix(".md").write_text(header + "```\n" + text + "\n```\n")
    print(json.dumps(data) if args.json else text)
    return 0


def _report(r, dtype: str) -> str:
    verdict = "at the memory wall" if r.step_over_bound <= 1.5 else "above the wall: overhead or compute, not bandwidth"
    backends = ", ".join(f"{name} x{n}" for name, n in r.backends.items())
    lines = [
        f"weights {r.weights} ({dtype} activations): linears on {backends}; "
        f"row-exact: {'yes' if r.row_exact else 'no'}",
        f"  read bandwidth          {r.bandwidth_gb_s:8.1f} GB/s",
        _cache_line(r),
        f"  weights read per step   {r.weight_bytes / 1e6:8.1f} MB{_fits(r)}",
        f"  weights in memory       {r.memory_bytes / 1e6:8.1f} MB (with the float embedding table)",
        f"  step lower bound        {r.bound_ms:8.2f} ms  ({1000 / r.bound_ms:.0f} tokens/s){_cached_bound(r)}",
        f"  measured decode step    {r.step_ms:8.2f} ms  ({1000 / r.step_ms:.0f} tokens/s)",
        f"  measured / bound        {r.step_over_bound:8.2f}x  -> {verdict}",
        f"  of a step: linears      {r.linear_ms:8.2f} ms, the rest {r.other_ms:.2f} ms "
        "(norms, RoPE, cache writes, attention, sampling, Python)",
        "  forward over k tokens, cost relative to k = 1 (verification of k - 1 drafts costs this):",
        "    " + "  ".join(f"k={k}:{c:.2f}" for k, c in r.k_costs.items()),
    ]
    lines += [f"  note: {note}" for note in r.kernel_notes or []]
    return "\n".join(lines)


def _cache_line(r) -> str:
    from selfspec.calibration.roofline import CACHE_SIZES_MB, CACHE_SPEEDUP

    if not r.cache_mb:
        first = CACHE_SIZES_MB[0]
        return f"  last-level cache        none found (even {first} MB read under {CACHE_SPEEDUP}x memory's speed)"
    return (
        f"  last-level cache        {r.cache_bandwidth_gb_s:8.1f} GB/s reading up to {r.cache_mb} MB "
        f"({r.cache_bandwidth_gb_s / r.bandwidth_gb_s:.1f}x memory)"
    )


def _fits(r) -> str:
    """Whether a step's weights fit in the cache (a draft's weights and the KV cache come on top)."""
    return {None: "", True: " (within the cache)", False: " (more than the cache)"}[r.in_cache]


def _cached_bound(r) -> str:
    """The bound again at the cache's bandwidth, where a step's weights fit in it."""
    if not r.in_cache:
        return ""
    return f"; {r.weight_bytes / (r.cache_bandwidth_gb_s * 1e6):.2f} ms read from the cache"


def main(argv: list[str] | None = None) -> int:
    return run(PROG, build_parser(), argv, _body)
