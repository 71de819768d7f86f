"""`selfspec check-distribution`: is speculative sampling lossless on this model and these settings?
Samples continuations with and without speculation and compares them statistically."""

from __future__ import annotations

import json

from selfspec.decoding.round import DRAFTERS, EXIT_DRAFTERS

from .common import (
    ArgumentParser,
    add_draft_head_args,
    add_model_args,
    draft_head_arg,
    engine_from_args,
    positive_int,
    run,
)

PROG = "selfspec check-distribution"


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog=PROG,
        description="Sample S continuations with and without speculation; compare their log-likelihoods "
        "(two-sample Kolmogorov-Smirnov) and first tokens (chi-square). Exit code 0 when consistent with "
        "lossless at the 1%% level, 1 when not.",
    )
    add_model_args(p)
    p.add_argument("--prompt", default="Tell me a short story.", help="prompt text (chat-templated unless --raw)")
    p.add_argument("--raw", action="store_true", help="no chat template")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument(
        "--draft-layers", type=positive_int, metavar="N", help="draft depth (exit, head; int4/int8: optional)"
    )
    p.add_argument("--gamma", type=positive_int, default=4, metavar="K")
    p.add_argument("--drafter", choices=DRAFTERS, default="auto", help="what drafts (see selfspec generate --help)")
    p.add_argument("--ngram", type=positive_int, default=3, help="lookup/hybrid suffix length")
    p.add_argument("--samples", type=positive_int, default=500, help="continuations per arm (default 500)")
    p.add_argument("--new-tokens", type=positive_int, default=8, help="tokens per continuation (default 8)")
    p.add_argument("--seed", type=int, default=0)
    add_draft_head_args(p)
    p.add_argument("--json", action="store_true")
    return p


def _body(args) -> int:
    from selfspec import SamplingParams, SpecConfig
    from selfspec.calibration.distribution import SIGNIFICANCE, compare

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    if params.greedy:
        raise ValueError("--temperature 0 is greedy: there is no distribution to compare (use > 0)")
    if args.draft_layers is None and args.drafter in EXIT_DRAFTERS:
        raise ValueError(
            f"--drafter {args.drafter} needs --draft-layers N (or use --drafter int4, int8, lookup, hybrid)"
        )
    config = SpecConfig(args.draft_layers, args.gamma, args.drafter, args.ngram)
    engine = engine_from_args(args, draft_head=draft_head_arg(args))
    drafter = engine.drafter(config)  # as in generate: auto is the head at its depth, else the exit
    head = engine.heads.get(config.draft_layers) if drafter.name == "head" else None
    prompt = engine.encode(args.prompt, chat=not args.raw)
    report = compare(engine.model, prompt, params, config, args.samples, args.new_tokens, args.seed, drafter=drafter)
    if args.json:
        print(json.dumps({**report.to_dict(), "draft_head": head.kind if head else None}))
    else:
        verdict = "consistent with lossless" if report.lossless else "NOT consistent with lossless"
        print(
            f"{report.samples} samples x {report.new_tokens} tokens per arm, drafter {drafter.name}, "
            f"N={config.draft_layers}, "
            f"gamma={config.num_speculative_tokens}, "
            f"T={params.temperature}, top_p={params.top_p}, top_k={params.top_k}, "
            f"draft head: {head.kind if head else 'none'}\n"
            f"log-likelihood: mean {report.mean_loglik_plain:.3f} plain vs "
            f"{report.mean_loglik_speculative:.3f} speculative; "
            f"KS statistic {report.statistic:.4f}, p-value {report.pvalue:.4f}\n"
            f"first token: chi-square p-value {report.first_token_pvalue:.4f}\n"
            f"verdict at the {SIGNIFICANCE:.0%} level: {verdict}"
        )
    return 0 if report.lossless else 1


def main(argv: list[str] | None = None) -> int:
    return run(PROG, build_parser(), argv, _body)
