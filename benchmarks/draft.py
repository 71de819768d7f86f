"""What one draft token of a quantized self-draft costs: a round's draft (one native call for a lone
greedy row) timed again and again at one context, the draft's K/V rolled back after each, and (with
--verify) a round's verification between them (γ + 1 tokens through the target's layers and its greedy
head, on the same sequence), which streams the target's own weights and head through the caches as
decoding does: on the Xeon with AMX (bf16, γ 4, four runs each) a draft token cost 2.1-2.6 ms alone and
3.0-4.7 ms between verifications at a 100-token context: the target's 8-bit head (28 MB) pushes what
decoding reads past the ~100 MB the last-level cache holds there (benchmarks/bandwidth.c).

    python benchmarks/draft.py [--dtype bfloat16] [--drafter int4] [--contexts 78,300,1000] [--gamma 6]
                               [--repeats 60] [--verify] [--threads 2]

Prints the median and least ms per draft token per context; compare two code trees by running it
alternately with PYTHONPATH pointing at each (this VM drifts by 10-30 % within an hour)."""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from selfspec.decoding.engine import Engine  # noqa: E402
from selfspec.decoding.round import RoundInput, SpecConfig  # noqa: E402
from selfspec.decoding.sampling import SamplingParams  # noqa: E402


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--drafter", default="int4", choices=["int4", "int8"])
    ap.add_argument("--contexts", default="78,300,1000")
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--verify", action="store_true", help="a round's verification between drafts")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    engine = Engine.from_pretrained(dtype=args.dtype, num_threads=args.threads, profile=False)
    drafter = engine.drafter(SpecConfig(None, args.gamma, args.drafter))
    model, cache = engine.model, engine.cache
    print(f"{args.dtype} target ({model.kernels.backend}), {drafter.describe()}")
    for context in map(int, args.contexts.split(",")):
        seq = cache.allocate()
        model.prefill(cache, seq, [100 + (i * 7919) % 30000 for i in range(context)])
        times = []
        for _ in range(args.repeats):
            step = RoundInput([seq], [5], [SamplingParams(temperature=0)], [None], [args.gamma], drafter)
            start = time.perf_counter()
            drafter.propose(model, cache, step)
            times.append(time.perf_counter() - start)
            cache.truncate(seq, context)
            if args.verify:
                h = model.forward(torch.tensor([[7] * (args.gamma + 1)], device=model.device), cache, [seq])
                model.greedy(h[0])
                cache.truncate(seq, context)
        cache.free(seq)
        ms = [t / args.gamma * 1e3 for t in times]
        print(f"context {context:5d}: {statistics.median(ms):.2f} ms a draft token (least {min(ms):.2f})")


if __name__ == "__main__":
    main()
