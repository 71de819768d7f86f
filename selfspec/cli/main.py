"""`selfspec <command> ...`: dispatches to selfspec.cli.<command>.main, importing only that module."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "generate": "generate text, with or without self-speculation",
    "check-distribution": "test that speculative sampling leaves the output distribution unchanged",
    "calibrate": "measure acceptance, costs and speedup per draft depth, gamma and bucket; write a profile",
    "estimate": "the speedup model: tokens per round, cost per round, speedup, best gamma",
    "roofline": "memory bandwidth, the decode step's lower bound, and the k-token forward cost curve",
    "bench": "Spec-Bench-style speedup table against transformers peers",
    "serve": "OpenAI-compatible HTTP server with continuous batching",
    "train-draft": "train draft exit adapters by self-distillation",
}


def _usage() -> str:
    lines = ["usage: selfspec <command> [options]   (selfspec <command> --help for details)", "", "commands:"]
    lines += [f"  {name:<12} {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from selfspec import __version__

        print(f"selfspec {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"selfspec: error: unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"selfspec.cli.{argv[0].replace('-', '_')}")
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
