"""The server under hostile load, side by side for each code tree given (this one, and e.g. an older
checkout), in one run: `python benchmarks/serving.py --faults [--trees new=.,before=/tmp/old]`.

Each tree's `selfspec serve` runs as its own process on the default model (so its memory can be read),
one after the other, and faces the same faults:
- long prompt: the largest gap between two chunks of a streaming client while a 7,000-token prompt is
  admitted, beside the same stream's largest gap before it arrived (target <= 0.5 s at 2 threads);
- hog: the latency of a small request (4 output tokens) sent behind one whose prompt (100 tokens) and
  max_tokens (8,080) could fill the whole KV cache, beside the same request alone (target <= 2 s);
- big body: the time to the answer to a 50 MB body (target: a 413 within 0.5 s) and the server's RSS
  after it (target <= +100 MB);
- load: output tokens/s at 16 streaming clients (no worse than before);
- single: one streaming client's output tokens/s (200 tokens, speculation off and the default), the
  server's pace where nothing else competes.
Writes benchmarks/results/serving_faults.{json,md}."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine import describe, markdown  # noqa: E402

LONG_PROMPT_TOKENS = 7000
BODY_BYTES = 50 * 2**20
HOG_MAX_TOKENS = 8080
SINGLE_TOKENS = 200
TIMEOUT = 90.0  # seconds a fault may take before it is reported as "> TIMEOUT"
# The long prompt alone takes ~40 s here; admitted beside a stream it shares every iteration with that
# stream's rounds, so it takes about twice that.
LONG_TIMEOUT = 300.0


class Server:
    """`selfspec serve` from one code tree, as a child process."""

    def __init__(self, tree: Path, threads: int) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
        cmd = [sys.executable, "-m", "selfspec.cli.main", "serve", "--port", str(self.port), "--threads", str(threads)]
        cmd += ["--served-model-name", "default"]
        self.proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server in {tree} exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError(f"server in {tree} did not start")

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def stream(url: str, body: dict, stamps: list[float], stop: threading.Event | None = None) -> None:
    """Streams a completion, appending the time of every chunk that carries text to `stamps`."""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        for line in r.iter_lines():
            if stop is not None and stop.is_set():
                return
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    stamps.append(time.perf_counter())


def completion(url: str, body: dict, timeout: float = TIMEOUT) -> float:
    start = time.perf_counter()
    httpx.post(url + "/v1/completions", json=body, timeout=timeout).raise_for_status()
    return time.perf_counter() - start


def body(prompt, max_tokens: int, stream: bool = False) -> dict:
    return {
        "model": "default",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def long_prompt(url: str) -> dict:
    stamps: list[float] = []
    client = threading.Thread(
        target=stream, args=(url, body("Write a long story about a lighthouse.", 600, True), stamps)
    )
    client.start()
    while len(stamps) < 30 and client.is_alive():
        time.sleep(0.05)
    before = [b - a for a, b in zip(stamps, stamps[1:])]
    arrival = time.perf_counter()
    ids = [(i * 7919) % 40000 + 100 for i in range(LONG_PROMPT_TOKENS)]
    try:
        admitted = completion(url, body(ids, 1), LONG_TIMEOUT)
    except httpx.TimeoutException:
        admitted = f"> {LONG_TIMEOUT:.0f} (timed out)"
    except httpx.HTTPError as e:
        admitted = f"{type(e).__name__}"
    done = time.perf_counter()
    window = [b - a for a, b in zip(stamps, stamps[1:]) if b > arrival and a < done]
    client.join(timeout=TIMEOUT)
    return {
        "max_gap_before_s": max(before, default=float("nan")),
        "median_gap_before_s": sorted(before)[len(before) // 2] if before else float("nan"),
        "max_gap_during_s": max(window, default=float("nan")),
        "gaps_during": len(window),
        "long_prompt_seconds": admitted,
    }


def hog(url: str) -> dict:
    small = body("Say hi.", 4)
    alone = completion(url, small)
    stop, stamps = threading.Event(), []
    # ~100 prompt tokens + max_tokens 8080: a worst case of every block of the default 8192-token cache
    hog_body = body([(i * 31) % 5000 + 100 for i in range(100)], HOG_MAX_TOKENS, True)
    client = threading.Thread(target=stream, args=(url, hog_body, stamps, stop))
    client.start()
    while not stamps and client.is_alive():
        time.sleep(0.05)
    try:
        behind = completion(url, small)
    except httpx.HTTPError as e:
        behind = f"{type(e).__name__}"
    stop.set()  # the hog's client goes away at its next chunk
    client.join(timeout=TIMEOUT)
    return {"small_alone_s": alone, "small_behind_hog_s": behind}


def big_body(server: Server) -> dict:
    before = server.rss_mb()
    payload = b'{"model": "default", "prompt": "' + b"a" * BODY_BYTES + b'"}'
    start = time.perf_counter()
    try:
        r = httpx.post(
            server.url + "/v1/completions",
            content=payload,
            timeout=TIMEOUT,
            headers={"content-type": "application/json"},
        )
        status = r.status_code
    except httpx.HTTPError as e:  # a server may answer and close before the upload ends
        status = type(e).__name__
    seconds = time.perf_counter() - start
    time.sleep(1)
    return {"status": status, "seconds": seconds, "rss_before_mb": before, "rss_after_mb": server.rss_mb()}


def load(url: str, prompts: list[str], clients: int = 16, max_tokens: int = 64) -> dict:
    def client(i: int) -> int:
        stamps: list[float] = []
        stream(url, body(prompts[i % len(prompts)], max_tokens, True), stamps)
        return len(stamps)

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    wall = time.perf_counter() - start
    return {"clients": clients, "output_tokens_per_second": clients * max_tokens / wall, "wall_seconds": wall}


def single(url: str) -> dict:
    out = {}
    for mode, spec in (("plain", {"enabled": False}), ("default", None)):
        stamps: list[float] = []
        request = body("Write a long story about a lighthouse.", SINGLE_TOKENS, True)
        if spec is not None:
            request["speculative"] = spec
        stream(url, request, stamps)
        # from the first text chunk to the last: decoding only (no prefill)
        out[f"{mode}_tokens_per_second"] = SINGLE_TOKENS / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
    return out


def run(trees: dict[str, Path], threads: int, out: Path) -> None:
    from decode import dev_prompts

    prompts = [q["turns"][0] for q in dev_prompts(16) if len(q["turns"][0]) < 1500]
    results = {}
    for name, tree in trees.items():
        print(f"== {name} ({tree})", flush=True)
        server = Server(tree, threads)
        try:
            r = {}
            for fault, fn in (
                ("long_prompt", lambda: long_prompt(server.url)),
                ("hog", lambda: hog(server.url)),
                ("big_body", lambda: big_body(server)),
                ("load", lambda: load(server.url, prompts)),
                ("single", lambda: single(server.url)),
            ):
                r[fault] = fn()
                print(f"  {fault}: {r[fault]}", flush=True)
            results[name] = r
        finally:
            server.stop()
    report = {
        "benchmark": "serving_faults",
        "machine": describe(threads),
        "trees": {k: str(v) for k, v in trees.items()},
        "results": results,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving_faults.json").write_text(json.dumps(report, indent=2))
    (out / "serving_faults.md").write_text(_markdown(report))


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.2f}"
    return f"> {TIMEOUT:.0f} (timed out)" if x == "ReadTimeout" else str(x)


def _markdown(report: dict) -> str:
    names = list(report["results"])
    rows = [
        ("stream's largest gap before the long prompt (s)", "long_prompt", "max_gap_before_s"),
        (
            f"stream's largest gap while a {LONG_PROMPT_TOKENS}-token prompt is admitted (s; target <= 0.5)",
            "long_prompt",
            "max_gap_during_s",
        ),
        ("the long prompt's own latency (s)", "long_prompt", "long_prompt_seconds"),
        ("small request alone (s)", "hog", "small_alone_s"),
        (
            f"small request behind a 100-token prompt with max_tokens {HOG_MAX_TOKENS} (s; target <= 2)",
            "hog",
            "small_behind_hog_s",
        ),
        ("50 MB body: status", "big_body", "status"),
        ("50 MB body: time to the answer (s; target <= 0.5)", "big_body", "seconds"),
        ("RSS before / after it (MB; target <= +100)", "big_body", None),
        ("16 streaming clients: output tok/s", "load", "output_tokens_per_second"),
        ("one streaming client, speculation off: output tok/s", "single", "plain_tokens_per_second"),
        ("one streaming client, the default policy: output tok/s", "single", "default_tokens_per_second"),
    ]
    lines = [
        "# Serving under faults",
        "",
        markdown(report["machine"]),
        "Default model, fp32, greedy; each tree's `selfspec serve` in its own process, one after the other. "
        + ", ".join(f"`{k}`: {v}" for k, v in report["trees"].items()),
        "",
        "| fault | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for label, fault, key in rows:
        cells = []
        for n in names:
            r = report["results"][n][fault]
            cells.append(f"{r['rss_before_mb']:.0f} / {r['rss_after_mb']:.0f}" if key is None else _fmt(r[key]))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
