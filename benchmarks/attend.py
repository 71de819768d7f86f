"""native.c's decoding attention alone (RoPE, the cache write and `attend` over the paged cache) for the
default model's shape (9 query heads, 3 KV heads, head_dim 64): one step's 30 calls for k query rows at
a given context, on random keys and values in one layer's cache.

    python benchmarks/attend.py [--contexts 300,1000] [--queries 1,2,4,8] [--dtypes float32,bfloat16]
                                [--threads 2] [--repeats 30] [--cold]

The same cache serves all 30 calls, so it stays in the caches where a real step reads 30 layers' (at a
1000-token context 46 MB in fp32, from memory): this isolates the arithmetic, which is what grows with k.
`--cold` gives each call a cache of its own, as a step's layers have (AMD EPYC Zen 4, 2 threads, 1000
tokens, one row: 2.2-3.0 ms in fp32 against 1.3 hot; software prefetches of the next 32 keys' keys and
values, tried, did not tell apart from that noise). Prints medians of `--repeats` timings per cell (ms per 30 calls)."""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402

from selfspec.kernels import native  # noqa: E402

HEADS, KV_HEADS, DIM, LAYERS, BLOCK = 9, 3, 64, 30, 16


def step_ms(lib, context: int, k: int, dtype: torch.dtype, threads: int, repeats: int, cold: bool = False) -> float:
    """Median ms of 30 `attend` calls for k rows after `context` cached positions (`cold`: each call on a
    cache of its own, as a step's 30 layers, read from memory where they outgrow the last-level cache)."""
    g = torch.Generator().manual_seed(0)
    blocks = (context + k) // BLOCK + 1
    slots = blocks * BLOCK
    caches = [torch.randn(2, KV_HEADS, slots, DIM, generator=g).to(dtype) for _ in range(LAYERS if cold else 1)]
    angle = torch.rand(context + k, DIM, generator=g)  # a real rotation: |cos|, |sin| <= 1
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    fresh = torch.randn(k, (HEADS + 2 * KV_HEADS) * DIM, generator=g).to(dtype)
    qkv = fresh.clone()  # rotated in place by each call: refreshed before it
    positions = torch.arange(context, context + k)
    tables = torch.arange(blocks)[None]
    num_tokens = torch.tensor([k])
    out = torch.empty(k, HEADS * DIM, dtype=dtype)
    ptr = ctypes.c_void_p
    args = [ptr(qkv.data_ptr()), ptr(cos.data_ptr()), ptr(sin.data_ptr()), None, ctypes.c_int64(slots)]
    args += [ptr(positions.data_ptr()), ptr(positions.data_ptr()), ptr(tables.data_ptr()), ctypes.c_int64(blocks)]
    args += [ctypes.c_int64(BLOCK), ptr(num_tokens.data_ptr()), ctypes.c_int64(1), ctypes.c_int64(k)]
    args += [ptr(out.data_ptr()), ctypes.c_int64(HEADS), ctypes.c_int64(KV_HEADS), ctypes.c_int64(DIM)]
    args += [ctypes.c_int64(0), ctypes.c_float(DIM**-0.5), ctypes.c_int(int(dtype == torch.bfloat16))]
    args += [ctypes.c_int(threads)]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in range(LAYERS):
            qkv.copy_(fresh)
            args[3] = ptr(caches[layer % len(caches)].data_ptr())
            lib.attend(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="300,1000")
    parser.add_argument("--queries", default="1,2,4,8")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--cold", action="store_true", help="a cache per layer, as a step reads them")
    args = parser.parse_args()
    built = native.library()
    if built is None:
        sys.exit(f"native.c is unavailable here: {native.unavailable()}")
    print(", ".join(f"{key}: {value}" for key, value in describe(args.threads).items()))
    for name in args.dtypes.split(","):
        for context in map(int, args.contexts.split(",")):
            dtype = getattr(torch, name)
            cells = [
                f"k={k} {step_ms(built.lib, context, k, dtype, args.threads, args.repeats, args.cold):.2f} ms"
                for k in map(int, args.queries.split(","))
            ]
            print(f"{name:9} context={context:5}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
