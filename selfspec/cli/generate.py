"""`selfspec generate`: one prompt in, text and decode statistics out."""

from __future__ import annotations

import json
import sys

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
    engine = engine_from_args(args, profile=args.profile, draft_head=draft_head_arg(args))
    if args.json:
        result = engine.generate(prompt, params, speculation=speculation, chat=not args.raw, category=args.category)
        print(json.dumps(result.to_dict()))
        return 0
    stats, reason = None, None
    for chunk in engine.stream_generate(
        prompt, params, speculation=speculation, chat=not args.raw, category=args.category
    ):
        print(chunk.text, end="", flush=True)
        stats, reason = chunk.stats, chunk.finish_reason
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
        # Against this request's own plain step (its first token), timed in the same run: a rough figure.
        plain = s.full_steps / s.full_step_seconds if s.full_step_seconds else 0.0
        speedup = f", ~{stats.tokens_per_second / plain:.2f}x its plain step" if plain else ""
        print(
            f"--- speculative ({s.drafter}{depth}, gamma={s.num_speculative_tokens}): {s.rounds} rounds, "
            f"acceptance {s.acceptance_rate:.2f} ({s.accepted}/{s.drafted}), "
            f"{s.mean_tokens_per_round:.2f} tokens/round, draft cost ratio c={s.draft_cost_ratio:.2f}{speedup}",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(PROG, build_parser(), argv, _body)
