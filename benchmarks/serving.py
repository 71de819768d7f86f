"""Serving throughput and latency vs concurrency, speculation off / on / policy, in one run.

    python benchmarks/serving.py [--dtype float32] [--weights auto] [--concurrency 1,2,4,8,16] [--max-tokens 64]
                                 [--requests-per-client 2] [--drafter int4 --gamma 4] [--temperature 0]
                                 [--passes 1]

Starts the server in-process on the default model, and for each mode and concurrency level runs that
many streaming clients, each sending its requests one after another (Spec-Bench dev prompts), greedy
or at `--temperature` (1 is OpenAI's default, what a client that sends none gets; each request seeded).
Reports output tokens/s, time to first token and inter-token latency (P50 / P99) as the clients saw
them, and the server's acceptance counters. Mode `on` asks every request to speculate; the scheduler
still switches speculation off for batches above the policy's max_batch_size, which shows where it
stops paying. `--passes N` runs every mode N times per level, the order reversed each pass, and
reports the means too: this VM's speed drifts within a level. Writes benchmarks/results/serving.{json,md}.

    python benchmarks/serving.py --faults [--trees new=.,before=PATH]

runs the fault scenarios of benchmarks/faults.py instead (a long prompt, a max_tokens hog, a 50 MB body,
16 clients) against each code tree's server, side by side."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import dev_prompts  # noqa: E402
from machine import describe, markdown  # noqa: E402

from selfspec import Engine  # noqa: E402
from selfspec.serving.server import create_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def start_server(engine: Engine, max_batch_size: int, loop_on_caller: bool = False):
    """The app under uvicorn on a thread -> (server, url, scheduler). loop_on_caller: the caller runs the
    scheduler's loop (scheduler.run(), on the main thread as `selfspec serve` does); else it gets a thread."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(engine, served_model_name="default", max_batch_size=max_batch_size, max_waiting=256)
    app.state.scheduler.on_caller_thread = loop_on_caller
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(400):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    return server, url, app.state.scheduler


def one_request(url: str, body: dict) -> dict:
    start = time.perf_counter()
    stamps = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    stamps.append(time.perf_counter())
    return {
        "ttft": stamps[0] - start if stamps else float("nan"),
        "gaps": [b - a for a, b in zip(stamps, stamps[1:])],
        "chunks": len(stamps),
    }


def scrape(url: str) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def run_level(
    url: str, prompts: list[str], clients: int, per_client: int, max_tokens: int, spec: dict | None, temperature: float
) -> dict:
    before = scrape(url)

    def client(i: int) -> list[dict]:
        results = []
        for j in range(per_client):
            body = {
                "model": "default",
                "messages": [{"role": "user", "content": prompts[(i * per_client + j) % len(prompts)]}],
                "max_tokens": max_tokens,
                "temperature": temperature,
                "seed": i * per_client + j,
                "ignore_eos": True,
                "stream": True,
            }
            if spec is not None:
                body["speculative"] = spec
            results.append(one_request(url, body))
        return results

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client, range(clients)) for r in rs]
    wall = time.perf_counter() - start
    after = scrape(url)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    gaps = [g for r in results for g in r["gaps"]]
    ttfts = [r["ttft"] for r in results]
    drafted = delta.get("selfspec_spec_decode_num_draft_tokens_total", 0)
    return {
        "clients": clients,
        "requests": len(results),
        "output_tokens_per_second": delta.get("selfspec_generation_tokens_total", 0) / wall,
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3,
        "ttft_p99_ms": percentile(ttfts, 99) * 1e3,
        "itl_p50_ms": percentile(gaps, 50) * 1e3,
        "itl_p99_ms": percentile(gaps, 99) * 1e3,
        "draft_tokens": drafted,
        "acceptance": delta.get("selfspec_spec_decode_num_accepted_tokens_total", 0) / drafted if drafted else None,
        "wall_seconds": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--weights", default="auto", help="the linears' weight format (auto, int4, int8, ...)")
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--drafter", default="int4", help="mode `on`'s drafter (exit, int4, int8, lookup, hybrid)")
    ap.add_argument("--draft-layers", type=int, default=None, help="mode `on`'s exit depth N (drafter exit)")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--passes", type=int, default=1, help="runs of every mode per level, order reversed each pass")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--faults", action="store_true", help="run the fault scenarios instead (benchmarks/faults.py)")
    ap.add_argument(
        "--trees", default="new=.", help="with --faults: name=path of each code tree to serve, comma-separated"
    )
    args = ap.parse_args()
    if args.faults:
        import faults

        trees = dict(item.split("=", 1) for item in args.trees.split(","))
        faults.run({name: Path(path).resolve() for name, path in trees.items()}, args.threads, args.out)
        return
    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained("default", dtype=args.dtype, weights=args.weights, kv_cache_tokens=32768)
    engine.preload()  # as `selfspec serve` does
    server, url, scheduler = start_server(engine, max_batch_size=16, loop_on_caller=True)
    prompts = [q["turns"][0] for q in dev_prompts(32) if len(q["turns"][0]) < 1500]
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = {
        "off": {"enabled": False},
        "on": {"enabled": True, "drafter": args.drafter, "num_speculative_tokens": args.gamma}
        | ({"draft_layers": args.draft_layers} if args.draft_layers else {}),
        "policy": None,
    }
    rows = []

    def clients_run() -> None:
        try:
            for clients in levels:  # modes interleaved per level, so drift hits all of them alike
                # each pass after the first reverses the order: the first mode of a level measured up to
                # 20 % apart from the same mode run last (int4, 16 clients, AMD EPYC Zen 4)
                order = [(k, m) for k in range(args.passes) for m in (modes if k % 2 == 0 else list(modes)[::-1])]
                for k, mode in order:
                    spec = modes[mode]
                    # Every mode sends the same prompts: without this, the modes after the first would
                    # find their prompts in the prefix cache. (The scheduler is idle between levels.)
                    if scheduler.prefix is not None:
                        scheduler.prefix.clear()
                    r = run_level(
                        url, prompts, clients, args.requests_per_client, args.max_tokens, spec, args.temperature
                    )
                    r["mode"], r["pass"] = mode, k
                    rows.append(r)
                    acc = "" if r["acceptance"] is None else f" acceptance {r['acceptance']:.2f}"
                    print(
                        f"{mode:6s} x{clients:2d}: {r['output_tokens_per_second']:6.1f} tok/s  "
                        f"TTFT p50 {r['ttft_p50_ms']:6.0f} ms p99 {r['ttft_p99_ms']:6.0f} ms  "
                        f"ITL p50 {r['itl_p50_ms']:5.0f} ms p99 {r['itl_p99_ms']:5.0f} ms{acc}",
                        flush=True,
                    )
        finally:
            server.should_exit = True
            scheduler.stop()

    workload = threading.Thread(target=clients_run)
    workload.start()
    scheduler.run()  # until the clients are done
    workload.join()
    policy = engine.policy
    result = {
        "benchmark": "serving",
        "machine": describe(args.threads),
        "dtype": args.dtype,
        "weights": engine.model.kernels.weights,
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
        "requests_per_client": args.requests_per_client,
        "spec_on": modes["on"],
        "policy": {
            "profile": bool(policy.profile),
            "max_batch_size": policy.max_batch_size,
            "temperature_threshold": policy.temperature_threshold,
        },
        "rows": rows,
        "mean_tokens_per_second": means(rows),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving.json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Serving: throughput and latency vs concurrency",
        "",
        markdown(result["machine"]),
        f"Default model, {args.dtype} activations, {engine.model.kernels.weights} weights, "
        + ("greedy" if args.temperature == 0 else f"T = {args.temperature:g} (seeded)")
        + f", {args.max_tokens} output tokens per request, "
        f"{args.requests_per_client} requests per client, streaming chat requests. Modes: `off` (no speculation), "
        f"`on` (every request asks for the {args.drafter} drafter, γ={args.gamma}"
        + (f", N={args.draft_layers}" if args.draft_layers else "")
        + "; the scheduler turns speculation off for "
        f"batches above the policy's max_batch_size={policy.max_batch_size}), `policy` (the default: the shipped "
        "calibration profile decides). Latencies as the clients saw them.",
        "",
        "| clients | mode | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | acceptance |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        lines.append(
            f"| {r['clients']} | {r['mode']} | {r['output_tokens_per_second']:.1f} | {r['ttft_p50_ms']:.0f} | "
            f"{r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.0f} | {r['itl_p99_ms']:.0f} | {acc} |"
        )
    if args.passes > 1:
        lines += [
            "",
            f"Output tok/s, mean of {args.passes} passes:",
            "",
            "| clients | mode | output tok/s |",
            "|---|---|---|",
        ]
        lines += [f"| {m['clients']} | {m['mode']} | {m['output_tokens_per_second']:.1f} |" for m in means(rows)]
    (args.out / "serving.md").write_text("\n".join(lines) + "\n")


def means(rows: list[dict]) -> list[dict]:
    """Each (clients, mode)'s output tok/s averaged over its passes, in the order first run."""
    runs: dict[tuple, list[float]] = {}
    for r in rows:
        runs.setdefault((r["clients"], r["mode"]), []).append(r["output_tokens_per_second"])
    return [{"clients": c, "mode": m, "output_tokens_per_second": sum(v) / len(v)} for (c, m), v in runs.items()]


if __name__ == "__main__":
    main()
