"""Would a draft that skips layers pay? The int4 self-draft's top-1 agreement with the target when it
runs only some of the model's layers: the first N (an early exit through the int4 copy), all but one
(each layer in turn), and the greedy sets that lose the least agreement per skipped layer.

    python benchmarks/layerskip.py [--dtype float32] [--prompts 24] [--new-tokens 40] [--max-prompt 400]
                                   [--skips 10] [--threads 2] [--out benchmarks/results/layerskip]

Teacher-forced on the target's own greedy answers to dev prompts (every 10th, prompts up to
--max-prompt tokens): the int4 copy (the GGUF's own codes, the engine's shortlisted head) runs the
whole sequence with the chosen layers, a skipped layer passing its residual stream on unchanged, and its
argmax at each answer position is compared with the target's token. A draft token costs about what the
layers it runs read, so skipping a fraction s of the layers pays only if agreement stays near the full
draft's. Writes {out}.json/.md."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe, save  # noqa: E402

from selfspec import Engine, SamplingParams  # noqa: E402
from selfspec.data import DEV_SET  # noqa: E402


def answers(engine: Engine, prompts: list[str], new_tokens: int, max_prompt: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the target's greedy answer) per prompt of at most max_prompt tokens."""
    out = []
    for prompt in prompts:
        ids = engine.encode(prompt)
        if len(ids) <= max_prompt:
            answer = engine.generate(ids, SamplingParams(temperature=0, max_tokens=new_tokens), speculation=None)
            out.append((ids, answer.token_ids))
    return out


def agreement(engine: Engine, seqs: list[tuple[list[int], list[int]]], layers: list[int], model=None) -> float:
    """The top-1 agreement with the answers of `model` (default: the engine's int4 draft) on the engine's
    cache, running only `layers` (in order)."""
    draft, cache = model or engine.draft_model("int4"), engine.cache
    hits = total = 0
    for ids, answer in seqs:
        full = ids + answer
        seq = cache.allocate()
        batch = cache.prepare([seq], [len(full)])
        h = F.embedding(torch.tensor([full]), draft.embed_weight)
        state, y = draft.ops.prepare(batch), None
        for i in layers:
            h, y = draft._layer(i, h, y, batch, state, cache.layers[i])
        cache.free(seq)
        h = h if y is None else h + y
        predicted = draft.logits(h[0, len(ids) - 1 : -1]).argmax(-1)
        hits += int((predicted == torch.tensor(answer)).sum())
        total += len(answer)
    return hits / total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--max-prompt", type=int, default=400)
    ap.add_argument("--skips", type=int, default=10, help="layers the greedy search skips at most")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "layerskip"))
    args = ap.parse_args()
    engine = Engine.from_pretrained(dtype=args.dtype, num_threads=args.threads, profile=False)
    n = engine.model.num_layers
    questions = [json.loads(line) for line in DEV_SET.read_text().splitlines() if line.strip()]
    prompts = [q["turns"][0] for q in questions][::10][: args.prompts]
    start = time.perf_counter()
    with torch.inference_mode():
        seqs = answers(engine, prompts, args.new_tokens, args.max_prompt)
        positions = sum(len(a) for _, a in seqs)

        def without(skipped: set[int]) -> float:
            return agreement(engine, seqs, [i for i in range(n) if i not in skipped])

        full = without(set())
        print(f"{len(seqs)} prompts, {positions} positions; all {n} layers: {full:.4f}", flush=True)
        first = {k: agreement(engine, seqs, list(range(k))) for k in (n - 2, n - 4, n - 6)}
        print("first N: " + ", ".join(f"{k}: {a:.4f}" for k, a in first.items()), flush=True)
        single = {i: without({i}) for i in range(n)}
        print("one layer skipped: " + ", ".join(f"{i}: {a:.3f}" for i, a in single.items()), flush=True)
        greedy, skipped = [], set()
        candidates = sorted(single, key=lambda i: -single[i])[: 2 * args.skips]  # the least harmful alone
        for _ in range(args.skips):
            scores = {c: without(skipped | {c}) for c in candidates if c not in skipped}
            best = max(scores, key=scores.get)
            skipped.add(best)
            greedy.append({"skipped": sorted(skipped), "agreement": round(scores[best], 4)})
            print(f"{len(skipped)} skipped {sorted(skipped)}: {scores[best]:.4f}", flush=True)
    machine = describe(args.threads)
    result = {
        "machine": machine,
        "dtype": args.dtype,
        "prompts": len(seqs),
        "positions": positions,
        "all_layers": round(full, 4),
        "first_n": {str(k): round(a, 4) for k, a in first.items()},
        "one_skipped": {str(i): round(a, 4) for i, a in single.items()},
        "greedy": greedy,
        "seconds": round(time.perf_counter() - start, 1),
    }
    lines = [
        f"int4 self-draft ({args.dtype} target), top-1 agreement with the target's greedy answers, teacher-forced: "
        f"{len(seqs)} dev prompts, {positions} positions. All {n} layers: {full:.4f}.",
        "",
        "| layers run | agreement |",
        "|---|---|",
        *(f"| first {k} | {a:.4f} |" for k, a in first.items()),
        *(f"| all but {len(g['skipped'])}: skipping {g['skipped']} | {g['agreement']:.4f} |" for g in greedy),
        "",
        "One layer skipped: " + ", ".join(f"{i}: {a:.3f}" for i, a in single.items()) + ".",
    ]
    save(args.out, result, lines)


if __name__ == "__main__":
    main()
