"""Pieces shared by the CLI commands: one-line errors with exit code 2, and the model options."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from selfspec.decoding.round import DRAFTERS
from selfspec.device import DEVICES
from selfspec.errors import SelfspecError
from selfspec.kernels.choice import WEIGHTS

EXIT_BAD_INPUT = 2


class UsageError(Exception):
    """Raised by ArgumentParser.error; reported on one line with exit code 2."""


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print the whole usage block; one line is enough
        raise UsageError(message)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), a checkpoint dir, or a .gguf")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="activations' (compute) dtype")
    p.add_argument(
        "--weights",
        default="auto",
        choices=WEIGHTS,
        help="the linears' weight format: auto (the dtype's own, on the fastest exact kernel here), float32, "
        "bfloat16, int8 (per channel) or int4 (groups of 32; a 4-bit GGUF's own codes)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=DEVICES,
        help="where the model runs: cpu (default) or cuda (a CUDA build of torch and an NVIDIA GPU)",
    )
    p.add_argument("--threads", type=positive_int, help="torch threads (default: all cores)")
    p.add_argument(
        "--kv-cache-tokens", type=positive_int, help="KV cache capacity in tokens (default: min(context, 8192))"
    )


def engine_from_args(args: argparse.Namespace, **options):
    """The engine the model options (add_model_args) describe; `options`: more Engine.from_pretrained
    arguments (profile, draft_head)."""
    from selfspec import Engine

    return Engine.from_pretrained(
        args.model,
        dtype=args.dtype,
        weights=args.weights,
        kv_cache_tokens=args.kv_cache_tokens,
        num_threads=args.threads,
        device=args.device,
        **options,
    )


def cpu_only(args: argparse.Namespace, prog: str, why: str) -> None:
    """For commands that measure or train on the CPU: `--device cuda` is refused with the reason."""
    if args.device != "cpu":
        raise SelfspecError(f"{prog} runs on the CPU only ({why}): drop --device {args.device}")


def run(
    prog: str, parser: argparse.ArgumentParser, argv: list[str] | None, body: Callable[[argparse.Namespace], int]
) -> int:
    """Parses argv and runs body; input errors become `prog: error: ...` on stderr and exit code 2."""
    try:
        args = parser.parse_args(argv)
        return body(args)
    except (UsageError, SelfspecError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculation (default: the calibration profile's policy decides)")
    g.add_argument("--draft-layers", type=positive_int, metavar="N", help="draft with the first N layers")
    g.add_argument("--gamma", type=positive_int, metavar="K", help="draft tokens per round (default 4)")
    g.add_argument(
        "--drafter",
        choices=DRAFTERS,
        default="auto",
        help="what drafts: 'exit' (the first N layers), 'head' (the trained draft head at N), "
        "'auto' (the profile's choice; with --draft-layers the head where one exists at N, else the exit), "
        "'int4'/'int8' (the model's own weights at 4/8 bits: all layers, or the first N), "
        "'lookup' (n-gram match over the prompt and output), "
        "'hybrid' (lookup where the last --ngram tokens recur, else int4)",
    )
    g.add_argument(
        "--ngram",
        type=positive_int,
        metavar="N",
        help="lookup: longest suffix matched, backing off to 2 tokens (1 with --ngram 1); hybrid: the suffix "
        "that must recur for lookup to draft (default 3)",
    )
    g.add_argument("--no-speculate", action="store_true", help="plain decoding, whatever else is set")
    g.add_argument("--profile", help="calibration profile JSON (default: the shipped one for this model, if any)")
    g.add_argument("--category", help="request category for the profile's buckets (e.g. qa, translation)")
    add_draft_head_args(g)


def add_draft_head_args(g) -> None:
    g.add_argument("--draft-head", help="trained draft head (.safetensors; default: the shipped one for this model)")
    g.add_argument("--no-draft-head", action="store_true", help="draft with the plain early exit")


def spec_from_args(args: argparse.Namespace):
    from selfspec.decoding.round import SpecConfig

    if args.no_speculate:
        return None
    if args.drafter == "auto" and args.draft_layers is None:
        if args.gamma is not None or args.ngram is not None:
            raise ValueError("--gamma/--ngram need --drafter or --draft-layers N (what drafts)")
        return "auto"
    if args.draft_layers is None and args.drafter in ("exit", "head"):
        raise ValueError(f"--drafter {args.drafter} needs --draft-layers N (the exit depth)")
    return SpecConfig(args.draft_layers, args.gamma or 4, args.drafter, args.ngram or 3)


def draft_head_arg(args: argparse.Namespace):
    """--no-draft-head -> False (none), --draft-head PATH -> PATH, else None (the shipped default)."""
    if args.no_draft_head:
        return False
    return args.draft_head
