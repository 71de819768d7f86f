"""Scaling out: one engine vs two replicas on Ray Serve, on the same cores, at several client counts.

    python benchmarks/replicas.py [--model default] [--cores 2] [--clients 4,16] [--max-tokens 64]
                                  [--requests-per-client 2] [--setups single,ray1,ray2]

Setups: `single` (the plain `selfspec serve` process, no Ray: the baseline), `rayN` (N replicas behind
the Ray Serve gateway, --cores split between them: `ray1` isolates what the gateway costs, `ray2` what a
second replica buys). Each client sends its streaming chat requests (Spec-Bench dev prompts) one after
another, greedy, ignore_eos. Reports output tokens/s (the server's own count), request latency and time
to first token (P50 / P99, as the clients saw them). Writes benchmarks/results/replicas.{json,md}.
Needs Ray: pip install -e '.[ray]'."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import dev_prompts  # noqa: E402
from machine import describe, markdown  # noqa: E402
from serving import one_request, percentile, scrape, start_server  # noqa: E402

from selfspec import Engine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAX_BATCH_SIZE = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_level(url: str, model: str, prompts: list[str], clients: int, per_client: int, max_tokens: int) -> dict:
    before = scrape(url)

    def client(i: int) -> list[dict]:
        results = []
        for j in range(per_client):
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompts[(i * per_client + j) % len(prompts)]}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            start = time.perf_counter()
            r = one_request(url, body)
            r["latency"] = time.perf_counter() - start
            results.append(r)
        return results

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client, range(clients)) for r in rs]
    wall = time.perf_counter() - start
    tokens = scrape(url).get("selfspec_generation_tokens_total", 0) - before.get("selfspec_generation_tokens_total", 0)
    latencies, ttfts = [r["latency"] for r in results], [r["ttft"] for r in results]
    return {
        "clients": clients,
        "requests": len(results),
        "output_tokens_per_second": tokens / wall,
        "latency_p50_ms": percentile(latencies, 50) * 1e3,
        "latency_p99_ms": percentile(latencies, 99) * 1e3,
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3,
        "ttft_p99_ms": percentile(ttfts, 99) * 1e3,
        "wall_seconds": wall,
    }


def serve_single(args):
    """The plain server in this process, on all --cores."""
    torch.set_num_threads(args.cores)
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, kv_cache_tokens=args.kv_cache_tokens)
    # the scheduler on a thread of its own, as in each Ray replica (see Scheduler.run for what that costs)
    server, url, _ = start_server(engine, max_batch_size=MAX_BATCH_SIZE)  # served as "default"
    return url, "default", lambda: setattr(server, "should_exit", True)


def serve_ray(args, replicas: int):
    """`replicas` engines on a local Ray cluster, --cores shared out between them."""
    from selfspec.serving.replicas import deploy

    served = deploy(
        args.model,
        replicas=replicas,
        threads=max(1, args.cores // replicas),
        port=free_port(),
        dtype=args.dtype,
        kv_cache_tokens=args.kv_cache_tokens,
        served_model_name="default",
        max_batch_size=MAX_BATCH_SIZE,
        max_waiting=256,
    )
    return served.url, "default", served.shutdown


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cores", type=int, default=os.cpu_count(), help="torch threads in all, split among replicas")
    ap.add_argument("--setups", default="single,ray1,ray2")
    ap.add_argument("--clients", default="4,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--kv-cache-tokens", type=int, default=32768)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    prompts = [q["turns"][0] for q in dev_prompts(32) if len(q["turns"][0]) < 1500]
    levels = [int(c) for c in args.clients.split(",")]
    rows = []
    for setup in args.setups.split(","):
        replicas = 1 if setup == "single" else int(setup.removeprefix("ray"))
        url, model, stop = serve_single(args) if setup == "single" else serve_ray(args, replicas)
        try:
            run_level(url, model, prompts, 1, 1, 4)  # warm-up: first-request costs stay out of the figures
            for clients in levels:
                r = run_level(url, model, prompts, clients, args.requests_per_client, args.max_tokens)
                r.update(setup=setup, replicas=replicas, threads_per_replica=max(1, args.cores // replicas))
                rows.append(r)
                print(
                    f"{setup:7s} x{clients:2d}: {r['output_tokens_per_second']:6.1f} tok/s  latency p50 "
                    f"{r['latency_p50_ms']:6.0f} ms p99 {r['latency_p99_ms']:6.0f} ms  "
                    f"TTFT p50 {r['ttft_p50_ms']:5.0f} ms",
                    flush=True,
                )
        finally:
            stop()
    write(args, rows)


def write(args, rows: list[dict]) -> None:
    result = {
        "benchmark": "replicas",
        "machine": describe(args.cores),
        "model": args.model,
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "requests_per_client": args.requests_per_client,
        "max_batch_size": MAX_BATCH_SIZE,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replicas.json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Scaling out: replicas on Ray Serve",
        "",
        markdown(result["machine"]),
        f"Model {args.model}, {args.dtype}, greedy, {args.max_tokens} output tokens per request, "
        f"{args.requests_per_client} streaming chat requests per client, batch size {MAX_BATCH_SIZE} per replica. "
        f"All setups on the same {args.cores} cores: `single` is the plain server (no Ray) on all of them; "
        f"`rayN` is N replicas behind the Ray Serve gateway, the cores split between them. A second machine "
        "would add cores instead of splitting them.",
        "",
        "| setup | replicas x threads | clients | output tok/s | latency p50 ms | latency p99 ms | TTFT p50 ms "
        "| TTFT p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['setup']} | {r['replicas']} x {r['threads_per_replica']} | {r['clients']} | "
            f"{r['output_tokens_per_second']:.1f} | {r['latency_p50_ms']:.0f} | {r['latency_p99_ms']:.0f} | "
            f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} |"
        )
    (args.out / "replicas.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
