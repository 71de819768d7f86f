"""`selfspec estimate`: the speedup model of brief §3 for given α, γ and c, and the best γ."""

from __future__ import annotations

import json

from .common import ArgumentParser, positive_int, run

PROG = "selfspec estimate"


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog=PROG,
        description="Expected tokens per round E = (1 - a^(g+1)) / (1 - a), cost per round g*c + v (in full "
        "forwards), speedup = overhead * E / (g*c + v); and the speedup of every g from 1 to --max-gamma.",
    )
    p.add_argument("--alpha", type=float, required=True, help="per-token acceptance probability, [0, 1]")
    p.add_argument("--gamma", type=positive_int, required=True, help="draft tokens per round")
    p.add_argument("--c", type=float, required=True, help="draft step cost / full forward cost")
    p.add_argument("--verify-cost", type=float, default=1.0, help="verification cost / full forward (default 1)")
    p.add_argument("--overhead", type=float, default=1.0, help="factor for unmodelled overhead, e.g. 0.8 (default 1)")
    p.add_argument("--max-gamma", type=positive_int, default=8)
    p.add_argument("--json", action="store_true")
    return p


def _body(args) -> int:
    from selfspec.calibration.speedup import best_gamma, estimate

    e = estimate(args.alpha, args.gamma, args.c, args.verify_cost, args.overhead)
    table = [estimate(args.alpha, g, args.c, args.verify_cost, args.overhead) for g in range(1, args.max_gamma + 1)]
    best = best_gamma(args.alpha, args.c, args.verify_cost, args.overhead, args.max_gamma)
    if args.json:
        print(json.dumps({"estimate": e.to_dict(), "table": [t.to_dict() for t in table], "best_gamma": best.gamma}))
        return 0
    print(
        f"alpha={e.alpha:g} gamma={e.gamma} c={e.c:g} v={e.verify_cost:g} overhead={e.overhead:g}\n"
        f"expected tokens/round {e.tokens_per_round:.3f} | cost/round {e.cost_per_round:.3f} full forwards | "
        f"speedup {e.speedup:.3f}x"
    )
    print("\n gamma  tokens/round  cost/round  speedup")
    for t in table:
        mark = "  <- best" if t.gamma == best.gamma else ""
        print(f" {t.gamma:5d}  {t.tokens_per_round:12.3f}  {t.cost_per_round:10.3f}  {t.speedup:6.3f}x{mark}")
    if best.speedup < 1.0:
        print("no gamma pays: speculation is slower than plain decoding at this alpha and c")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(PROG, build_parser(), argv, _body)
