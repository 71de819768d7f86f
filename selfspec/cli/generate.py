"""`selfspec generate`: one prompt in, text and decode statistics out."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

from .common import (
    ArgumentParser,
    add_model_args,
    add_spec_args,
    draft_head_arg,
    engine_from_args,
    positive_int,
    run,
    spec_from_args,
)

PROG = "selfspec generate"


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Generate a completion for one prompt.")
    p.add_argument("prompt", nargs="?", help="prompt text (read from stdin when omitted and stdin is not a terminal)")
    add_model_args(p)
    p.add_argument("--max-tokens", type=positive_int, default=256, help="tokens to generate at most (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, (0, 1] (default 1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, help="sampling seed (default: random)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    p.add_argument("--system", help="system message (chat mode only)")
    p.add_argument("--raw", action="store_true", help="send the prompt as-is, without the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, finish_reason, stats")
    p.add_argument(
        "--compare-plain",
        action="store_true",
        help="decode the prompt again without speculation (same settings) and print both speeds, their ratio, "
        "a draft token's cost in plain steps and, when greedy, whether the outputs are identical",
    )
    add_spec_args(p)
    return p


def _prompt(args) -> str | list[dict]:
    text = args.prompt
    if text is None:
        if sys.stdin.isatty():
            raise ValueError("no prompt: pass it as an argument or on stdin")
        text = sys.stdin.read()
    if not text.strip():
        raise ValueError("empty prompt: pass some text")
    if args.raw:
        if args.system:
            raise ValueError("--system needs the chat template: drop --raw")
        return text
    messages = [{"role": "system", "content": args.system}] if args.system else []
    return messages + [{"role": "user", "content": text}]


def _body(args) -> int:
    from selfspec import SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    prompt = _prompt(args)
    speculation = spec_from_args(args)
    if args.compare_plain and speculation is None:
        raise ValueError("--compare-plain with --no-speculate: there is nothing to compare; drop one of them")
    engine = engine_from_args(args, profile=args.profile, draft_head=draft_head_arg(args))
    how = {"chat": not args.raw, "category": args.category}  # every decoding of the prompt below
    if args.compare_plain:  # both ways once, briefly: what loads on first use (a draft copy) is not timed
        brief = replace(params, max_tokens=min(params.max_tokens, 8))
        for way in (speculation, None):
            engine.generate(prompt, brief, speculation=way, **how)
    if args.json:
        result = engine.generate(prompt, params, speculation=speculation, **how)
        out = result.to_dict()
        if args.compare_plain:
            out["plain"] = _against_plain(engine, prompt, params, how, result.stats, result.token_ids)
        print(json.dumps(out))
        return 0
    stats, reason, ids = None, None, []
    for chunk in engine.stream_generate(prompt, params, speculation=speculation, **how):
        print(chunk.text, end="", flush=True)
        stats, reason = chunk.stats, chunk.finish_reason
        ids.append(chunk.token_id)
    print()
    print(
        f"--- prompt: {stats.prompt_tokens} tokens, {stats.prompt_tokens_per_second:.1f} tokens/s | "
        f"generation: {stats.generated_tokens} tokens, {stats.tokens_per_second:.1f} tokens/s | "
        f"time to first token: {stats.time_to_first_token * 1000:.0f} ms | finish: {reason}",
        file=sys.stderr,
    )
    print(f"--- weights: {stats.weights} on the {stats.backend} kernels, {stats.ops} glue ops", file=sys.stderr)
    print(f"--- speculation: {stats.spec_policy}", file=sys.stderr)
    if stats.spec:
        s = stats.spec
        depth = "" if s.draft_layers is None else f", N={s.draft_layers}"
        print(
            f"--- speculative ({s.drafter}{depth}, gamma={s.num_speculative_tokens}): {s.rounds} rounds, "
            f"acceptance {s.acceptance_rate:.2f} ({s.accepted}/{s.drafted}), "
            f"{s.mean_tokens_per_round:.2f} tokens/round, draft cost ratio c={s.draft_cost_ratio:.2f} "
            "(against its one plain step)",
            file=sys.stderr,
        )
    if args.compare_plain:
        c = _against_plain(engine, prompt, params, how, stats, ids)
        same = "" if c["identical"] is None else "; output identical" if c["identical"] else "; output DIFFERS"
        cost = f"; a draft token cost {c['draft_cost']:.2f} of a plain step" if c["draft_cost"] is not None else ""
        way = "with speculation" if stats.spec else "(this request decoded plain too: see the policy's decision)"
        print(
            f"--- against plain decoding of the same prompt: {c['tokens_per_second']:.1f} tokens/s, "
            f"{c['speedup']:.2f}x {way}{cost}{same}",
            file=sys.stderr,
        )
    return 0


def _against_plain(engine, prompt, params, how: dict, stats, ids: list[int]) -> dict:
    """The prompt decoded again without speculation, with the same settings: its speed, the ratio of
    `stats`' speed to it, a draft token's time in its mean step (rather than the one, often slower, first
    step that `draft_cost_ratio` is taken against: a cold first step made a 1.17x run look 2.0x), and,
    for greedy decoding, whether the two outputs are the same tokens."""
    plain = engine.generate(prompt, params, speculation=None, **how)
    tps, step = plain.stats.tokens_per_second, plain.stats.decode_seconds / max(plain.stats.steps, 1)
    s = stats.spec
    return {
        "tokens_per_second": tps,
        "speedup": stats.tokens_per_second / tps if tps else 0.0,
        "draft_cost": s.draft_seconds / s.drafted / step if s and s.drafted and step else None,
        "identical": plain.token_ids == ids if params.temperature == 0 else None,
    }


def main(argv: list[str] | None = None) -> int:
    return run(PROG, build_parser(), argv, _body)
