"""`selfspec train-draft`: self-distil draft heads (adapter kinds x exit layers), report held-out
agreement and expected acceptance, and save the best head."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from selfspec.data import DEV_SET

from .calibrate import int_range, load_questions
from .common import ArgumentParser, add_model_args, cpu_only, positive_int, run

PROG = "selfspec train-draft"


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Train draft exit adapters by self-distillation on CPU.")
    add_model_args(p)
    p.add_argument(
        "--data",
        default=str(DEV_SET),
        help="JSONL with question_id, category, turns (Spec-Bench format; default: the shipped Spec-Bench dev half)",
    )
    p.add_argument("--draft-layers", default="6,10,14,18", help="exit layers N to train (default 6,10,14,18)")
    p.add_argument("--kind", default="affine,mlp", help="adapter kinds: affine, mlp, attn (default affine,mlp)")
    p.add_argument("--vocab-subset", type=int, default=8192, help="draft vocabulary size, 0 = all (default 8192)")
    p.add_argument("--steps", type=positive_int, default=1500)
    p.add_argument("--batch-size", type=positive_int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--rank", type=positive_int, default=256, help="mlp adapter width (default 256)")
    p.add_argument("--new-tokens", type=positive_int, default=96, help="response tokens per prompt (default 96)")
    p.add_argument("--heldout", type=float, default=0.15, help="fraction of prompts held out (default 0.15)")
    p.add_argument("--max-prompts", type=positive_int, help="use at most this many prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", required=True, help="where to save the best head (.safetensors); <out>.json gets the report"
    )
    p.add_argument("--plot", help="PNG: held-out acceptance vs N per kind, draft cost and predicted speedup")
    p.add_argument("--json", action="store_true")
    return p


def _body(args) -> int:
    import torch
    from tqdm import tqdm

    from selfspec.calibration.distill import TrainConfig, choose_best, split_prompts, train_resumable
    from selfspec.decoding.head import KINDS
    from selfspec.model.loader import load

    kinds = [k.strip() for k in args.kind.split(",") if k.strip()]
    for k in kinds:
        if k not in KINDS:
            raise ValueError(f"--kind {k!r}: use one of {', '.join(KINDS)}")
    if not 0 < args.heldout < 1:
        raise ValueError(f"--heldout {args.heldout}: use a fraction in (0, 1)")
    if args.vocab_subset < 0:
        raise ValueError(f"--vocab-subset {args.vocab_subset}: use >= 0")
    cpu_only(args, PROG, "distillation is written for CPU tensors")
    loaded = load(args.model, args.dtype)
    model, tok = loaded.model, loaded.tokenizer
    depths = int_range(args.draft_layers)
    if min(depths) < 1 or max(depths) >= model.num_layers:
        raise ValueError(
            f"--draft-layers {args.draft_layers}: this model has {model.num_layers} layers, "
            f"use 1..{model.num_layers - 1}"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    questions = load_questions(args.data, per_category=10**9)[: args.max_prompts]

    def template(q):
        return tok.apply_chat_template(
            [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True, tokenize=False
        )

    encoded = [(q, tok(template(q), add_special_tokens=False).input_ids) for q in questions]
    encoded = [(q, p) for q, p in encoded if len(p) + args.new_tokens < model.config.max_position_embeddings]
    prompts = [p for _, p in encoded]
    eos = set(model.config.eos_token_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
    cfg = TrainConfig(
        draft_layers=depths,
        kinds=kinds,
        vocab_subset=args.vocab_subset,
        rank=args.rank,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        new_tokens=args.new_tokens,
        heldout_fraction=args.heldout,
        seed=args.seed,
    )
    metadata = {
        "base_model": args.model,
        "data": args.data,
        "training_command": "selfspec train-draft "
        + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["train-draft"] else sys.argv[1:]),
    }
    bar = tqdm(total=len(depths) * len(kinds) * args.steps, desc="training", file=sys.stderr)
    results = train_resumable(
        model,
        prompts,
        eos,
        cfg,
        metadata,
        Path(f"{args.out}.work"),
        progress=bar.update,
        log=lambda m: print(m, file=sys.stderr),
    )
    bar.close()
    best, costs = choose_best(model, results)
    best.head.metadata["choice"] = best.choice
    _, held = split_prompts(prompts, cfg.heldout_fraction, cfg.seed)  # the split train_resumable used
    best.head.metadata["heldout_question_ids"] = [str(encoded[i][0]["question_id"]) for i in held]
    best.head.save(args.out)
    report = {"out": args.out, "best": best.choice, "costs": costs, "results": [r.to_dict() for r in results]}
    Path(f"{args.out}.json").write_text(json.dumps(report, indent=1))
    Path(f"{args.out}.md").write_text(_markdown(report, best, metadata["training_command"]))
    if args.plot:
        from selfspec.calibration.plots import write_train_draft_plot

        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        write_train_draft_plot(report, args.plot)
    if args.json:
        print(json.dumps(report))
    else:
        c = best.choice
        print(
            f"best: N={best.draft_layers} {best.kind}: held-out alpha@T=0 {best.heldout['acceptance']['0']:.3f}, "
            f"c={c['c']:.2f}, v={c['verify_cost']:.2f}, predicted {c['predicted_speedup']:.2f}x "
            f"at gamma={c['gamma']} -> {args.out}"
        )
    return 0


def _markdown(report: dict, best, command: str) -> str:
    from selfspec.calibration.calibrate import machine_info

    costs, m = report["costs"], machine_info()
    lines = [
        "# Trained draft exits: held-out acceptance, draft cost and predicted speedup",
        "",
        f"Machine: {m['platform']}, {m['cores']} cores, {m['torch_threads']} torch threads, torch {m['torch']}. "
        f"Full step {costs['full_step_seconds'] * 1000:.1f} ms. Command: `{command}`.",
        "",
        "α: held-out greedy acceptance (top-1 agreement with the full model) and expected acceptance at T=0.7; "
        "`full vocab`: the same adapter scoring every token; c: draft step / full step (measured); "
        "v: verification / full step at the head's best γ; predicted: E/(γc + v) at that γ.",
        "",
        "| N | kind | α T=0 | α T=0.7 | α full vocab | α plain exit | c | c full vocab | best γ | v | predicted |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        key, ch = f"{r['draft_layers']}-{r['kind']}", r["choice"]
        full = r.get("full_vocab", {}).get("acceptance", {}).get("0")
        lines.append(
            f"| {r['draft_layers']} | {r['kind']} | {r['heldout']['acceptance']['0']:.3f} | "
            f"{r['heldout']['acceptance']['0.7']:.3f} | "
            + (f"{full:.3f}" if full is not None else "-")
            + f" | {r['plain_exit']['acceptance']['0']:.3f} | {costs['draft_cost'][key]:.3f} | "
            + (f"{costs['draft_cost_full_vocab'][key]:.3f}" if key in costs["draft_cost_full_vocab"] else "-")
            + f" | {ch['gamma']} | {ch['verify_cost']:.2f} | {ch['predicted_speedup']:.2f}x |"
        )
    lines += [
        "",
        f"Best: N={best.draft_layers} {best.kind}, γ={best.choice['gamma']}, "
        f"predicted {best.choice['predicted_speedup']:.2f}x.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run(PROG, build_parser(), argv, _body)
