"""Would a draft that reads fewer bytes than the 4-bit codes pay? A draft token streams the same 66 MB of
codes as a step of the default model, so it costs about what a step's memory traffic does; a draft that
reads less must keep the int4 draft's top-1 agreement with the target. Two ways, teacher-forced on the
target's own greedy answers to dev prompts (as benchmarks/layerskip.py):

- **MLP activation sparsity** in the int4 draft: per token, only the largest (1 - s) of the 1536 MLP
  activations are kept. `gate` ranks them by abs(silu(gate)) (CATS: the up rows and down columns of the
  rest would not be read: a fraction s of up and down, which hold half of a layer's bytes); `act` ranks
  by abs(silu(gate) * up) (up computed whole, only down's columns skipped: a fraction s of a quarter of
  a layer's bytes).
- **Fewer bits**: the float32 target's weights re-quantized to 3 or 2 bits (asymmetric, min/max, groups
  of 16 or 32: shortlist.py's `requantized`), all linears or the MLP's alone, with the target's own LM head.

    python benchmarks/thinner.py [--prompts 24] [--new-tokens 40] [--max-prompt 400] [--threads 2]
                                 [--out benchmarks/results/thinner]

Writes {out}.json/.md."""

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
from layerskip import agreement, answers  # noqa: E402
from machine import describe, save  # noqa: E402
from shortlist import requantized  # noqa: E402

from selfspec import Engine  # noqa: E402
from selfspec.data import DEV_SET  # noqa: E402
from selfspec.kernels import Dense  # noqa: E402

SPARSITY = (0.3, 0.5, 0.6, 0.7, 0.8)
ALL = ("qkv", "o", "gate_up", "down")
BITS = [(3, 32, ALL), (3, 16, ALL), (3, 32, ("gate_up", "down")), (3, 32, ("gate_up",)), (2, 16, ALL)]


def sparse_silu_mul(s: float, by: str):
    """ops.silu_mul keeping, per token, the (1 - s) largest activations ranked `by` gate or act."""

    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        g = F.silu(gate)
        a = g * up
        score = g.abs() if by == "gate" else a.abs()
        kept = score.topk(max(1, round((1 - s) * score.shape[-1])), dim=-1).values[..., -1:]
        return a * (score >= kept)

    return silu_mul


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--max-prompt", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "thinner"))
    args = ap.parse_args()
    engine = Engine.from_pretrained(dtype="float32", num_threads=args.threads, profile=False)
    questions = [json.loads(line) for line in DEV_SET.read_text().splitlines() if line.strip()]
    prompts = [q["turns"][0] for q in questions][::10][: args.prompts]
    start = time.perf_counter()
    layers = list(range(engine.model.num_layers))
    with torch.inference_mode():
        seqs = answers(engine, prompts, args.new_tokens, args.max_prompt)
        positions = sum(len(a) for _, a in seqs)
        draft = engine.draft_model("int4")
        own = draft.ops.silu_mul
        full = agreement(engine, seqs, layers)
        print(f"{len(seqs)} prompts, {positions} positions; the int4 draft: {full:.4f}", flush=True)
        sparse = {}
        for by in ("gate", "act"):
            for s in SPARSITY:
                draft.ops.silu_mul = sparse_silu_mul(s, by)
                sparse[f"{by} {s}"] = agreement(engine, seqs, layers)
                print(f"sparse by {by} at {s}: {sparse[f'{by} {s}']:.4f}", flush=True)
        draft.ops.silu_mul = own
        # A second float32 engine whose linears are replaced: the first keeps the answers' target.
        other = Engine.from_pretrained(dtype="float32", num_threads=args.threads, profile=False)
        weights = {(i, n): getattr(lw, n).dequantized().float() for i, lw in enumerate(other.model.layers) for n in ALL}
        fewer = {}
        for bits, group, names in BITS:
            for (i, n), w in weights.items():
                setattr(
                    other.model.layers[i],
                    n,
                    Dense(requantized(w, bits, group) if n in names else w, None, torch.float32),
                )
            key = f"{bits} bits, groups of {group}, {'all linears' if names == ALL else '+'.join(names)}"
            fewer[key] = agreement(other, seqs, layers, other.model)
            print(f"{key}: {fewer[key]:.4f}", flush=True)
    machine = describe(args.threads)
    result = {
        "machine": machine,
        "prompts": len(seqs),
        "positions": positions,
        "int4_draft": round(full, 4),
        "sparse": {k: round(v, 4) for k, v in sparse.items()},
        "fewer_bits": {k: round(v, 4) for k, v in fewer.items()},
        "seconds": round(time.perf_counter() - start, 1),
    }
    lines = [
        f"Top-1 agreement with the float32 target's greedy answers, teacher-forced: {len(seqs)} dev prompts, "
        f"{positions} positions. The int4 draft (the GGUF's own codes): {full:.4f}.",
        "",
        "| int4 draft, MLP activations dropped | " + " | ".join(f"s = {s}" for s in SPARSITY) + " |",
        "|---|" + "---|" * len(SPARSITY),
        *(
            f"| ranked by {'abs(silu(gate))' if by == 'gate' else 'abs(silu(gate) * up)'} | "
            + " | ".join(f"{sparse[f'{by} {s}']:.4f}" for s in SPARSITY)
            + " |"
            for by in ("gate", "act")
        ),
        "",
        "| float32 target re-quantized | agreement |",
        "|---|---|",
        *(f"| {k} | {v:.4f} |" for k, v in fewer.items()),
    ]
    save(args.out, result, lines)


if __name__ == "__main__":
    main()
