"""The quantized draft's LM head: the shortlist (4-bit scores, the k highest recomputed from the float head)
against the int8 head it replaced, on the default model.

    python benchmarks/shortlist.py [--dtype float32] [--prompts 24] [--new-tokens 48] [--contexts 78,1000]
                                   [--threads 2] [--out benchmarks/results/shortlist]

Agreement: teacher-forced on the target's own greedy answers to dev prompts (every 10th), the int4
draft's layers give a hidden state per position; each head's top-1 is compared with the target's
greedy token (int8 head, the float head itself, the 4-bit head alone, the shortlist for several k), and
at T = 0.7 the expected acceptance sum(min(p, q)) of each head's distribution q against the target's p.
Time: an int4 draft of γ = 8 tokens (QuantizedDrafter.propose, greedy) after a prompt of each context,
the two heads alternating in blocks, medians per token. Writes {out}.json/.md."""

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

from selfspec import Engine, SamplingParams, SpecConfig  # noqa: E402
from selfspec.data import DEV_SET  # noqa: E402
from selfspec.decoding.quantized import Shortlist  # noqa: E402
from selfspec.decoding.round import RoundInput  # noqa: E402
from selfspec.kernels.choice import QUANTIZED  # noqa: E402

KS = (8, 16, 32, 64)


def teacher_forced(
    engine: Engine, prompts: list[str], new_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(draft hidden states [P, hidden] after the final norm, target logits [P, vocab], target tokens [P])
    at every position of the target's greedy answers."""
    model, draft, cache = engine.model, engine.draft_model("int4"), engine.cache
    hidden, logits = [], []
    for prompt in prompts:
        ids = engine.encode(prompt)
        answer = engine.generate(ids, SamplingParams(temperature=0, max_tokens=new_tokens), speculation=None)
        full = ids + answer.token_ids
        for net, out in ((draft, hidden), (model, logits)):
            seq = cache.allocate()
            h = net.forward(torch.tensor([full]), cache, batch=cache.prepare([seq], [len(full)]))
            cache.free(seq)
            h = h[0, len(ids) - 1 : -1]  # the states that predict the answer's tokens
            out.append(
                net.ops.add_norm(h, None, net.norm_weight, net.config.rms_norm_eps)[1]
                if net is draft
                else model.logits(h)
            )
    target = torch.cat(logits)
    return torch.cat(hidden), target, target.argmax(-1)


def agreement(engine: Engine, x: torch.Tensor, target: torch.Tensor, tokens: torch.Tensor, int8) -> dict:
    p = torch.softmax(target / 0.7, -1)
    shortlist = engine.draft_model("int4").head
    assert isinstance(shortlist, Shortlist)
    heads = {
        "int8": int8(x),
        "float": (x @ engine.model.head_weight.t()).float(),
        "int4 alone": shortlist.coarse(x).float(),
    }
    for k in KS:
        heads[f"shortlist k={k}"] = Shortlist(shortlist.coarse, shortlist.weight, k)(x)
    return {
        name: {
            "top1": round(float((scores.argmax(-1) == tokens).float().mean()), 4),
            "accept_t07": round(float(torch.minimum(p, torch.softmax(scores / 0.7, -1)).sum(-1).mean()), 4),
        }
        for name, scores in heads.items()
    }


def draft_times(engine: Engine, int8, contexts: list[int], blocks: int = 15) -> list[dict]:
    drafter = engine.drafter(SpecConfig(None, 8, "int4"))
    draft, cache, rows = drafter.draft, engine.cache, []
    heads = {"int8": int8, "shortlist": draft.head}
    for n in contexts:
        seq = cache.allocate()
        engine.model.prefill(cache, seq, [100 + i % 3000 for i in range(n)])
        step = RoundInput([seq], [17], [SamplingParams(temperature=0)], [None], gammas=[8], drafter=drafter)

        def once() -> float:
            start = time.perf_counter()
            drafter.propose(engine.model, cache, step)
            seconds = time.perf_counter() - start
            cache.truncate(seq, n)
            return seconds / 8 * 1e3

        ms = {name: [] for name in heads}
        for _ in range(blocks):
            for name, head in heads.items():
                draft.head = head
                once()
                ms[name].append(statistics.median(once() for _ in range(5)))
        draft.head = heads["shortlist"]
        cache.free(seq)
        ratio = statistics.median(b / a for a, b in zip(ms["int8"], ms["shortlist"]))
        rows.append(
            {"context": n}
            | {f"{k}_ms": round(statistics.median(v), 3) for k, v in ms.items()}
            | {"ratio": round(ratio, 3)}
        )
        r = rows[-1]
        print(f"context {n}: ms a draft token, int8 head {r['int8_ms']}, shortlist {r['shortlist_ms']} ({ratio:.3f})")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--contexts", default="78,1000")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "shortlist"))
    args = ap.parse_args()
    engine = Engine.from_pretrained(dtype=args.dtype, num_threads=args.threads)
    model = engine.model
    int8 = next(b for b in QUANTIZED["int8"] if b.unavailable(model.dtype) is None)(
        model.head_weight, None, model.dtype
    )
    questions = [json.loads(line) for line in DEV_SET.read_text().splitlines() if line.strip()]
    prompts = [q["turns"][0] for q in questions][::10][: args.prompts]
    with torch.inference_mode():
        x, target, tokens = teacher_forced(engine, prompts, args.new_tokens)
        agree = agreement(engine, x, target, tokens, lambda h: int8(h).float())
        for name, a in agree.items():
            print(f"{name:18s} top-1 agreement {a['top1']:.4f}  T=0.7 acceptance {a['accept_t07']:.4f}", flush=True)
        times = draft_times(engine, int8, [int(n) for n in args.contexts.split(",")])
    machine = describe(args.threads)
    result = {"machine": machine, "dtype": args.dtype, "positions": len(tokens), "agreement": agree, "draft": times}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"{len(tokens)} teacher-forced positions ({len(prompts)} dev prompts, {args.dtype}).",
        "",
        "| draft head | top-1 agreement with the target | T = 0.7 expected acceptance |",
        "|---|---|---|",
        *(f"| {n} | {a['top1']} | {a['accept_t07']} |" for n, a in agree.items()),
        "",
        "| context | int8 head ms / draft token | shortlist ms / draft token | ratio (median of pairs) |",
        "|---|---|---|---|",
        *(f"| {r['context']} | {r['int8_ms']} | {r['shortlist_ms']} | {r['ratio']} |" for r in times),
    ]
    out.with_suffix(".md").write_text(markdown(machine) + "\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
