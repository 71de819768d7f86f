"""`selfspec serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import sys

from .common import ArgumentParser, add_model_args, engine_from_args, positive_int, run

PROG = "selfspec serve"


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog=PROG, description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."
    )
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the model id clients send (default: the --model argument)")
    p.add_argument("--max-batch-size", type=positive_int, default=16, help="requests decoded together (default 16)")
    p.add_argument("--max-waiting", type=int, default=64, help="queued requests before 429 (default 64)")
    p.add_argument("--profile", help="calibration profile JSON (default: the shipped one for this model, if any)")
    return p


def _body(args) -> int:
    import uvicorn

    from selfspec.serving.server import create_app

    if not 0 < args.port < 65536:
        raise ValueError(f"--port {args.port}: use 1..65535")
    if args.max_waiting < 0:
        raise ValueError(f"--max-waiting {args.max_waiting}: use >= 0")
    engine = engine_from_args(args, profile=args.profile)
    app = create_app(
        engine,
        served_model_name=args.served_model_name or args.model,
        max_batch_size=args.max_batch_size,
        max_waiting=args.max_waiting,
    )
    print(
        f"selfspec serving {args.served_model_name or args.model!r} on http://{args.host}:{args.port}/v1",
        file=sys.stderr,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(PROG, build_parser(), argv, _body)
