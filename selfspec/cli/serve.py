"""`selfspec serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import os
import sys

from .common import ArgumentParser, add_model_args, engine_from_args, positive_int, run

PROG = "selfspec serve"
API_KEY_ENV = "SELFSPEC_API_KEY"


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds > 0")
    return value


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def build_parser() -> ArgumentParser:
    from selfspec.serving.limits import Limits
    from selfspec.serving.runner import DEFAULT_HEADER_TIMEOUT, DEFAULT_KEEP_ALIVE_TIMEOUT, DEFAULT_SHUTDOWN_TIMEOUT

    p = ArgumentParser(
        prog=PROG, description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."
    )
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the model id clients send (default: the --model argument)")
    p.add_argument("--max-batch-size", type=positive_int, default=16, help="requests decoded together (default 16)")
    p.add_argument("--max-waiting", type=int, default=64, help="queued requests before 429 (default 64)")
    p.add_argument(
        "--max-request-tokens",
        type=positive_int,
        help="cap on prompt + max_tokens of one request (default: none; the context length still applies)",
    )
    p.add_argument("--profile", help="calibration profile JSON (default: the shipped one for this model, if any)")

    g = p.add_argument_group("access")
    g.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, if set; else no auth)",
    )
    g.add_argument(
        "--protect",
        type=_names,
        default=(),
        metavar="health,metrics,docs",
        help="also require the key on these (default: /health and /metrics stay open)",
    )
    g.add_argument("--docs", action="store_true", help="serve /docs, /redoc and /openapi.json (default: off)")

    g = p.add_argument_group("request and connection limits")
    g.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=Limits.max_body_bytes,
        help=f"larger request bodies get 413 before they are read (default {Limits.max_body_bytes})",
    )
    g.add_argument(
        "--max-messages",
        type=positive_int,
        default=Limits.max_messages,
        help="chat messages per request (default 1024)",
    )
    g.add_argument(
        "--max-message-chars",
        type=positive_int,
        help="characters in one chat message or completion prompt (default: 32 x the context length)",
    )
    g.add_argument(
        "--max-n", type=positive_int, default=Limits.max_n, help="largest n (choices) per request (default 16)"
    )
    g.add_argument(
        "--keep-alive-timeout",
        type=_seconds,
        default=DEFAULT_KEEP_ALIVE_TIMEOUT,
        help=f"seconds an idle keep-alive connection stays open (default {DEFAULT_KEEP_ALIVE_TIMEOUT:g})",
    )
    g.add_argument(
        "--header-timeout",
        type=_seconds,
        default=DEFAULT_HEADER_TIMEOUT,
        help=f"seconds a client may take to send a request's headers before it is disconnected "
        f"(default {DEFAULT_HEADER_TIMEOUT:g})",
    )
    g.add_argument(
        "--limit-concurrency",
        type=positive_int,
        help="open connections + requests in progress beyond which new requests get 503 (default: no limit)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        help="on SIGTERM/SIGINT, seconds requests in flight get to finish before they are cancelled; "
        f"a second signal cancels them at once (default {DEFAULT_SHUTDOWN_TIMEOUT:g})",
    )

    g = p.add_argument_group("scaling out (Ray Serve; pip install selfspec[ray])")
    g.add_argument(
        "--replicas",
        type=positive_int,
        default=1,
        help="engine replicas behind one endpoint, requests sharing a prompt prefix kept on one replica; "
        "--threads is then per replica (default 1: this process serves alone, without Ray)",
    )
    g.add_argument(
        "--ray-address",
        help="Ray cluster to deploy the replicas on ('auto', or the head's address; default: start one on "
        "this machine). The connection limits and timeouts above apply to the single server only",
    )
    return p


def _check(args) -> None:
    from selfspec.serving.auth import protected_paths

    if not 0 < args.port < 65536:
        raise ValueError(f"--port {args.port}: use 1..65535")
    if args.max_waiting < 0:
        raise ValueError(f"--max-waiting {args.max_waiting}: use >= 0")
    if args.protect and not args.api_key:
        raise ValueError(f"--protect needs --api-key (or ${API_KEY_ENV})")
    protected_paths(args.protect)  # a bad name fails now, not after loading the model
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout {args.shutdown_timeout}: use seconds >= 0")


def _app_options(args) -> dict:
    """create_app's options, as the model and limit flags set them (without the API key)."""
    return dict(
        served_model_name=args.served_model_name or args.model,
        max_batch_size=args.max_batch_size,
        max_waiting=args.max_waiting,
        max_request_tokens=args.max_request_tokens,
        max_body_bytes=args.max_body_bytes,
        max_messages=args.max_messages,
        max_message_chars=args.max_message_chars,
        max_n=args.max_n,
        docs=args.docs,
    )


def _body(args) -> int:
    if args.replicas > 1 or args.ray_address:
        return _body_replicas(args)
    from selfspec.serving.runner import make_server
    from selfspec.serving.server import create_app

    _check(args)
    engine = engine_from_args(args, profile=args.profile)
    engine.preload()  # before the first request, not inside its latency
    app = create_app(engine, api_key=args.api_key, protect=args.protect, **_app_options(args))
    server = make_server(
        app,
        host=args.host,
        port=args.port,
        shutdown_timeout=args.shutdown_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        header_timeout=args.header_timeout,
        limit_concurrency=args.limit_concurrency,
    )
    auth = "API key required" if args.api_key else "no API key"
    print(
        f"selfspec serving {args.served_model_name or args.model!r} on http://{args.host}:{args.port}/v1 ({auth})",
        file=sys.stderr,
    )
    return _serve(server, app.state.scheduler)


def _serve(server, scheduler) -> int:
    """The scheduler's loop on the main thread (Scheduler.run says why), uvicorn on another; the main
    thread also takes the signals, which start the server's graceful shutdown."""
    import signal
    import threading

    from uvicorn.server import HANDLED_SIGNALS

    failure: list[BaseException] = []

    def http() -> None:
        try:
            server.run()
        except BaseException as e:  # uvicorn exits with SystemExit when it cannot bind, for one
            failure.append(e)
        finally:
            scheduler.stop()  # lifespan shutdown did it already, unless uvicorn never started

    def on_signal(sig, _frame) -> None:
        server.request_shutdown()
        if not server.started:  # nothing to drain yet (and no event loop to drain on, early on)
            server.should_exit = True

    scheduler.on_caller_thread = True
    main = threading.current_thread() is threading.main_thread()  # only the main thread may take signals
    previous = {sig: signal.signal(sig, on_signal) for sig in HANDLED_SIGNALS} if main else {}
    web = threading.Thread(target=http, name="selfspec-http")
    web.start()
    try:
        scheduler.run()
    finally:
        web.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failure:
        raise failure[0]
    return 0


def _body_replicas(args) -> int:
    import functools

    from selfspec.serving import replicas

    replicas.require_ray(f"--replicas {args.replicas}")  # before any other work: exit 2 naming the extra
    _check(args)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.replicas)
    args.threads = threads  # each replica's engine_from_args reads it
    served = replicas.deploy_engines(
        # the replicas build their engines from these very flags (whatever model options they hold)
        functools.partial(engine_from_args, args, profile=args.profile),
        args.replicas,
        threads=threads,
        gpus=1 if getattr(args, "device", "cpu") == "cuda" else 0,
        ray_address=args.ray_address,
        host=args.host,
        port=args.port,
        gateway_options={"api_key": args.api_key, "protect": args.protect},
        app_options=_app_options(args),
    )
    auth = "API key required" if args.api_key else "no API key"
    print(
        f"selfspec serving {args.served_model_name or args.model!r} on {served.url}/v1 with {args.replicas} "
        f"replicas of {threads} threads on Ray Serve ({auth}); Ctrl-C stops",
        file=sys.stderr,
    )
    try:
        replicas.wait_for_signal()
    finally:
        served.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(PROG, build_parser(), argv, _body)
