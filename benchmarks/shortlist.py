"""The quantized draft's LM head: the shortlist (4-bit scores, the k highest recomputed from the float head)
against the int8 head it replaced, on the default model.

    python benchmarks/shortlist.py [--dtype float32] [--prompts 24] [--new-tokens 48] [--contexts 78,1000]
                                   [--threads 2] [--head-bits 4] [--out benchmarks/results/shortlist]

Agreement: teacher-forced on the target's own greedy answers to dev prompts (every 10th), the int4
draft's layers give a hidden state per position; each head's top-1 is compared with the target's
greedy token (int8 head, the float head itself, the coarse head alone, the shortlist for several k), and
at T = 0.7 the expected acceptance sum(min(p, q)) of each head's distribution q against the target's p.
Coarser heads: how often the float head's token is among the k highest scores of the head requantized
to 4, 3 or 2 bits (what a shortlist of k would recover), and their MB.
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
from machine import describe, save  # noqa: E402

from selfspec import Engine, SamplingParams, SpecConfig  # noqa: E402
from selfspec.data import DEV_SET  # noqa: E402
from selfspec.decoding.quantized import Shortlist, shortlist  # noqa: E402
from selfspec.decoding.round import RoundInput  # noqa: E402
from selfspec.kernels.choice import QUANTIZED  # noqa: E402

KS = (8, 16, 32, 64, 128)
COARSE = ((4, 32), (3, 32), (2, 32), (2, 16))  # (bits, group) of the coarser heads whose top k are checked


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
    head = engine.draft_model("int4").head
    assert isinstance(head, Shortlist)
    heads = {
        "int8": int8(x),
        "float": (x @ engine.model.head_weight.t()).float(),
        "coarse head alone": head.coarse(x).float(),
    }
    for k in KS:
        heads[f"shortlist k={k}"] = Shortlist(head.coarse, head.weight, k)(x)
    return {
        name: {
            "top1": round(float((scores.argmax(-1) == tokens).float().mean()), 4),
            "accept_t07": round(float(torch.minimum(p, torch.softmax(scores / 0.7, -1)).sum(-1).mean()), 4),
        }
        for name, scores in heads.items()
    }


def requantized(weight: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """weight [vocab, hidden] rounded to `bits`-bit codes per group of `group` inputs, each group's lowest
    value its offset and (highest - lowest) / (2^bits - 1) its scale (the GGUF Q4_1 rule at any width)."""
    g = weight.float().reshape(weight.shape[0], -1, group)
    low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((high - low) / (2**bits - 1)).clamp_min(torch.finfo(torch.float32).tiny)
    return (((g - low) / scale).round().clamp(0, 2**bits - 1) * scale + low).reshape(weight.shape)


def coverage(engine: Engine, x: torch.Tensor) -> list[dict]:
    """How often the float head's top token is among a coarser head's k highest scores (a shortlist of k
    recovers it, since the k are rescored exactly), for heads of fewer bits, with each head's MB (float16
    scale and offset per group): the bytes a draft token would save against what its agreement would lose.
    The heads are requantized from the float head in torch, not the kernels' own 4-bit head."""
    weight = engine.model.head_weight.float()
    best = (x.float() @ weight.t()).argmax(-1)  # [P]
    rows = []
    for bits, group in COARSE:
        top = (x.float() @ requantized(weight, bits, group).t()).topk(max(KS), -1).indices  # [P, 128]
        mb = weight.numel() * (bits + 32 / group) / 8 / 1e6
        found = {f"k={k}": round(float((top[:, :k] == best[:, None]).any(-1).float().mean()), 4) for k in KS}
        rows.append({"bits": bits, "group": group, "mb": round(mb, 1)} | found)
        print(f"{bits}-bit head, groups of {group} ({mb:.1f} MB): the float head's token in its top k", found)
    return rows


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
    ap.add_argument("--head-bits", type=int, choices=(4, 2), default=4, help="the shortlist's coarse head")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "shortlist"))
    args = ap.parse_args()
    engine = Engine.from_pretrained(dtype=args.dtype, num_threads=args.threads)
    model = engine.model
    if args.head_bits == 2:  # the draft's shortlist on the 2-bit head (decoding/quantized.py's SHORTLIST_2BIT)
        engine.draft_model("int4").head = shortlist(model.head_weight, 2)
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
        coarse = coverage(engine, x)
        times = draft_times(engine, int8, [int(n) for n in args.contexts.split(",")])
    machine = describe(args.threads)
    result = {
        "machine": machine,
        "dtype": args.dtype,
        "positions": len(tokens),
        "agreement": agree,
        "coarse": coarse,
        "draft": times,
    }
    lines = [
        f"{len(tokens)} teacher-forced positions ({len(prompts)} dev prompts, {args.dtype}); the draft's shortlist"
        f" on its {args.head_bits}-bit head.",
        "",
        "| draft head | top-1 agreement with the target | T = 0.7 expected acceptance |",
        "|---|---|---|",
        *(f"| {n} | {a['top1']} | {a['accept_t07']} |" for n, a in agree.items()),
        "",
        "| coarser head | MB | " + " | ".join(f"top {k}" for k in KS) + " |",
        "|---|---|" + "---|" * len(KS),
        *(
            f"| {r['bits']} bits, groups of {r['group']} | {r['mb']} | "
            + " | ".join(str(r[f"k={k}"]) for k in KS)
            + " |"
            for r in coarse
        ),
        "",
        "| context | int8 head ms / draft token | shortlist ms / draft token | ratio (median of pairs) |",
        "|---|---|---|---|",
        *(f"| {r['context']} | {r['int8_ms']} | {r['shortlist_ms']} | {r['ratio']} |" for r in times),
    ]
    save(args.out, result, lines)


if __name__ == "__main__":
    main()
