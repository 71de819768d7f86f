"""`selfspec calibrate`: measure acceptance, costs and speedup per draft depth, γ and bucket; write
the profile the runtime policy loads, and plots."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from selfspec.data import DEV_SET

from .common import (
    ArgumentParser,
    add_draft_head_args,
    add_model_args,
    cpu_only,
    draft_head_arg,
    engine_from_args,
    positive_int,
    run,
)

PROG = "selfspec calibrate"


def int_range(text: str) -> list[int]:
    """'4:28:2' (start:stop:step, stop included), '1-8', or '8,15,24'."""
    try:
        if ":" in text:
            a, b, *step = (int(x) for x in text.split(":"))
            return list(range(a, b + 1, step[0] if step else 1))
        if "-" in text:
            a, b = (int(x) for x in text.split("-"))
            return list(range(a, b + 1))
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{text!r} is not a list of integers: use 4:28:2, 1-8 or 8,15,24") from None


def float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{text!r} is not a list of numbers: use e.g. 0,0.3,0.6,0.9") from None


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Calibrate self-speculation for a model on representative prompts.")
    add_model_args(p)
    p.add_argument(
        "--data",
        default=str(DEV_SET),
        help="JSONL with question_id, category, turns (Spec-Bench format; default: the shipped Spec-Bench dev half)",
    )
    p.add_argument("--draft-layers", default="4:28:2", help="depths N to try (default 4:28:2)")
    p.add_argument("--gammas", default="1-8", help="draft lengths to try (default 1-8)")
    p.add_argument(
        "--drafters",
        default="int4,lookup,hybrid",
        help="drafters calibrated beside the exits at --draft-layers: int4, int8, lookup, hybrid (default: "
        "int4,lookup,hybrid; 'none' for exits only)",
    )
    p.add_argument("--temperatures", default="0,0.3,0.6,0.9")
    p.add_argument("--per-category", type=positive_int, default=3, help="prompts per category (default 3)")
    p.add_argument("--new-tokens", type=positive_int, default=64, help="continuation length per prompt (default 64)")
    p.add_argument(
        "--validate-prompts",
        type=positive_int,
        default=4,
        help="prompts timed (decoding, prefill left out) per configuration the prediction switches on (default 4)",
    )
    p.add_argument("--out", required=True, help="profile JSON to write; <out>.partial.jsonl keeps progress")
    p.add_argument("--plot", help="directory for PNG plots")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--all-prompts",
        action="store_true",
        help="also the prompts a draft head was trained on (default: its held-out ones)",
    )
    add_draft_head_args(
        p.add_argument_group("draft head (its depth is calibrated with it; the plain exit's acceptance is kept beside)")
    )
    p.add_argument("--json", action="store_true", help="print the profile summary as JSON")
    return p


def heldout_ids(engine) -> set[str]:
    """Question ids the engine's draft heads held out of their training (from their metadata)."""
    return {q for h in engine.heads.values() for q in h.metadata.get("heldout_question_ids", [])}


def load_questions(path: str, per_category: int, only: set[str] | None = None) -> list[dict]:
    """Spec-Bench style questions, at most `per_category` per category; `only`: these ids only."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--data {path}: no such file")
    out, seen = [], {}
    for i, line in enumerate(file.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            q["turns"][0], q["category"], q["question_id"]
        except (json.JSONDecodeError, KeyError, IndexError, TypeError):
            raise ValueError(
                f"--data {path}, line {i + 1}: expected JSON with question_id, category and turns"
            ) from None
        if only is not None and str(q["question_id"]) not in only:
            continue
        if seen.get(q["category"], 0) < per_category:
            seen[q["category"]] = seen.get(q["category"], 0) + 1
            out.append(q)
    if not out:
        raise ValueError(f"--data {path} holds no questions")
    return out


def _body(args) -> int:
    from tqdm import tqdm

    from selfspec.calibration.calibrate import CalibrationPlan, calibrate

    depths, gammas, temps = int_range(args.draft_layers), int_range(args.gammas), float_list(args.temperatures)
    if min(gammas) < 1 or max(gammas) > 32:
        raise ValueError(f"--gammas {args.gammas}: use values in 1..32")
    if min(temps) < 0:
        raise ValueError(f"--temperatures {args.temperatures}: use values >= 0")
    cpu_only(args, PROG, "it times draft and verify costs with the CPU's clock and profiles this CPU")
    engine = engine_from_args(args, profile=False, draft_head=draft_head_arg(args))
    # A draft head has seen its training prompts: acceptance measured on them would flatter it.
    held = None if args.all_prompts else heldout_ids(engine) or None
    questions = load_questions(args.data, args.per_category, held)
    if held:
        print(
            f"calibrating on the {len(questions)} prompts the draft head's training held out "
            "(--all-prompts: every prompt)",
            file=sys.stderr,
        )
    layers = engine.model.num_layers
    if min(depths) < 1 or max(depths) >= layers:
        raise ValueError(
            f"--draft-layers {args.draft_layers}: this model has {layers} layers, use depths in 1..{layers - 1}"
        )
    drafters = [] if args.drafters == "none" else args.drafters.split(",")
    unknown = [d for d in drafters if d not in ("int4", "int8", "lookup", "hybrid")]
    if unknown:
        raise ValueError(f"--drafters {args.drafters}: {unknown[0]!r} is not one of int4, int8, lookup, hybrid, none")
    quantized = tuple(d for d in ("int4", "int8") if d in drafters or ("hybrid" in drafters and d == "int4"))
    plan = CalibrationPlan(
        depths,
        gammas,
        temps,
        new_tokens=args.new_tokens,
        seed=args.seed,
        validate_prompts=args.validate_prompts,
        quantized=quantized,
        lookup="lookup" in drafters or "hybrid" in drafters,
    )
    profile, _, estimates = calibrate(engine, questions, plan, partial_path=f"{args.out}.partial.jsonl", progress=tqdm)
    profile.prompts = [str(q["question_id"]) for q in questions]
    profile.save(args.out)
    plots = []
    if args.plot:
        from selfspec.calibration.plots import write_calibration_plots

        plots = [str(p) for p in write_calibration_plots(profile, estimates, args.plot)]
    summary = {
        "profile": args.out,
        "plots": plots,
        "knee": profile.knee,
        "best_draft_layers": profile.best_draft_layers,
        "temperature_threshold": profile.temperature_threshold,
        "buckets_on": sum(1 for b in profile.buckets if (b.measured_speedup or b.predicted_speedup) >= 1.0),
        "buckets": len(profile.buckets),
        "validation": profile.validation,
        "max_batch_size": profile.max_batch_size,
        "batching": profile.batching,
        "sources": best_per_source(estimates),
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    print(
        f"profile written to {args.out} ({len(profile.buckets)} buckets, {summary['buckets_on']} with speculation on)"
    )
    print(
        f"acceptance knee at N={profile.knee}; best exit depth N={profile.best_draft_layers}; "
        f"speculation off above T={profile.temperature_threshold:g}"
    )
    for at in profile.cost_contexts:
        costs = ", ".join(f"{n} {c:.3f}" for n, c in at["draft_cost"].items())
        print(f"  costs at a {at['tokens']}-token context: c {costs}")
    for e in summary["sources"]:
        print(
            f"  all prompts/T={e['temperature']:g} {e['source']}: best gamma={e['gamma']}, "
            f"predicted {e['predicted_speedup']:.2f}x"
        )
    for v in profile.validation:
        print(
            f"  {v['category']}/T={v['temperature']:g} {v['source']} gamma={v['gamma']}: "
            f"predicted {v['predicted_speedup']:.2f}x, measured {v['measured_speedup']:.2f}x"
        )
    for b in profile.batching:
        tried = ", ".join(f"gamma={g} {r:.2f}x" for g, r in b.get("by_gamma", {}).items())
        print(
            f"  batch of {b['batch_size']}, {b['drafter']} gamma={b['gamma']}: measured {b['measured_speedup']:.2f}x"
            + (f" (tried {tried})" if tried else "")
        )
    print(f"speculation on for batches of up to {profile.max_batch_size} requests")
    for p in plots:
        print(f"plot: {p}")
    return 0


def best_per_source(estimates) -> list[dict]:
    """Each draft source's best γ and predicted speedup over every prompt, per temperature: how the
    sources compare on this machine, whichever one each bucket picked."""
    out = []
    for e in estimates:
        if e.category == "all" and e.length_bucket == "all":
            for source, by_gamma in e.speedup.items():
                g = max(by_gamma, key=by_gamma.get)
                out.append(
                    {"temperature": e.temperature, "source": source, "gamma": int(g), "predicted_speedup": by_gamma[g]}
                )
    return out


def main(argv: list[str] | None = None) -> int:
    return run(PROG, build_parser(), argv, _body)
