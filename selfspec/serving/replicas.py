"""N engine replicas on Ray Serve behind one OpenAI-compatible HTTP app, for traffic that outgrows one
process or one machine:

    from selfspec.serving.replicas import deploy
    served = deploy(model="default", replicas=2, threads=1)   # a local Ray cluster, or ray_address=...
    ... http://127.0.0.1:8000/v1 ...
    served.shutdown()

Each replica is its own Serve deployment (one replica each) running the single server's app (replica.py);
a gateway deployment (gateway.py) receives every HTTP request and picks the replica itself
(routing.py). One deployment per replica, rather than one deployment with N replicas, because the
gateway must address a given replica (prefix affinity, per-replica metrics) and a Serve handle to a
deployment only chooses among its replicas by load. Ray restarts a replica that dies, as it does any
Serve replica. Ray is an optional dependency: nothing here imports it before deploy() runs."""

from __future__ import annotations

import functools
import os
import signal
import threading
from dataclasses import dataclass
from typing import Callable

from ..errors import SelfspecError
from .gateway import Gateway, ReplicaGone, gateway_app
from .limits import Limits
from .replica import EngineReplica, Forwarded

APP_NAME = "selfspec"
INSTALL_HINT = "pip install selfspec[ray]"
# requests a replica accepts from the gateway beyond its scheduler's own bounds (batch + queue): /metrics
# calls and the requests the scheduler answers 429 to at once must not queue up inside Ray
HANDLE_MARGIN = 16
GATEWAY_MAX_ONGOING = 100_000  # the gateway only forwards: the replicas' schedulers are the bounds that count


class RayMissing(SelfspecError):
    pass


def require_ray(what: str = "replicas") -> None:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise RayMissing(f"{what}: Ray Serve is not installed here: {INSTALL_HINT}") from None


@dataclass
class Served:
    """A running deployment."""

    url: str  # e.g. http://127.0.0.1:8000 (the API is under /v1)
    replicas: int
    started_ray: bool  # this process started the Ray cluster (and stops it on shutdown)

    def shutdown(self) -> None:
        import ray
        from ray import serve

        serve.delete(APP_NAME)
        if self.started_ray:
            serve.shutdown()
            ray.shutdown()


def deploy(
    model: str = "default",
    replicas: int = 2,
    *,
    ray_address: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    threads: int | None = None,
    dtype: str = "float32",
    weights: str = "auto",
    kv_cache_tokens: int | None = None,
    engine_options: dict | None = None,
    api_key: str | None = None,
    protect: tuple[str, ...] = (),
    **app_options,
) -> Served:
    """Deploys `replicas` engines of `model` and the gateway, and returns once they all serve.
    ray_address: an existing cluster ("auto", "ray://head:10001", ...); None starts a local one.
    threads: torch threads (and Ray CPUs) per replica; default: this machine's cores shared out.
    engine_options: more Engine.from_pretrained arguments (profile, device, ...); app_options: create_app's
    (served_model_name, max_batch_size, max_waiting, the limits)."""
    threads = threads or max(1, (os.cpu_count() or 1) // replicas)
    engine_options = {"dtype": dtype, "weights": weights, "kv_cache_tokens": kv_cache_tokens, **(engine_options or {})}
    from selfspec import Engine

    make_engine = functools.partial(Engine.from_pretrained, model, num_threads=threads, **engine_options)
    app_options.setdefault("served_model_name", model)
    return deploy_engines(
        make_engine,
        replicas,
        threads=threads,
        gpus=1 if engine_options.get("device") == "cuda" else 0,
        ray_address=ray_address,
        host=host,
        port=port,
        gateway_options={"api_key": api_key, "protect": tuple(protect)},
        app_options=app_options,
    )


def deploy_engines(
    make_engine: Callable[[], object],
    replicas: int,
    *,
    threads: int,
    gpus: int = 0,
    ray_address: str | None,
    host: str,
    port: int,
    gateway_options: dict,
    app_options: dict,
) -> Served:
    """deploy() for an engine factory (the CLI passes its own, built from its model options)."""
    if replicas < 1:
        raise ValueError(f"replicas={replicas}: use >= 1")
    require_ray()
    import ray
    from ray import serve

    started = not ray.is_initialized() and ray_address is None
    if started:
        # One machine: declare enough CPUs for every replica's threads, even past the real cores (two
        # replicas sharing two cores is how the benchmark compares against one replica on both).
        ray.init(num_cpus=max(os.cpu_count() or 1, replicas * threads), include_dashboard=False)
    elif not ray.is_initialized():
        ray.init(address=ray_address)
    serve.start(http_options={"host": host, "port": port})
    # the body limit applies at the gateway, before a body travels to a replica
    body_limit = app_options.get("max_body_bytes", Limits.max_body_bytes)
    gateway_options = {**gateway_options, "max_body_bytes": body_limit}
    app = _application(make_engine, replicas, threads, gpus, gateway_options, app_options)
    serve.run(app, name=APP_NAME, route_prefix="/")
    return Served(f"http://{host}:{port}", replicas, started)


def _application(make_engine, replicas: int, threads: int, gpus: int, gateway_options: dict, app_options: dict):
    from ray import serve

    room = app_options.get("max_batch_size", 16)
    bound = room + app_options.get("max_waiting", 64) + HANDLE_MARGIN
    engine = serve.deployment(EngineReplica)
    engines = [
        engine.options(
            name=f"engine-{i}",
            num_replicas=1,
            max_ongoing_requests=bound,
            health_check_period_s=2,  # a dead replica is replaced within seconds (Serve's default: 10)
            ray_actor_options={"num_cpus": threads, "num_gpus": gpus},
        ).bind(make_engine, app_options)
        for i in range(replicas)
    ]
    gateway = serve.deployment(serve.ingress(_gateway_asgi)(GatewayDeployment)).options(
        name="gateway",
        num_replicas=1,  # the router's load counts are exact only while one gateway sees every request
        max_ongoing_requests=GATEWAY_MAX_ONGOING,
        ray_actor_options={"num_cpus": 0},
    )
    return gateway.bind(room, gateway_options, *engines)


def wait_for_signal() -> None:
    """Blocks until SIGINT or SIGTERM (then the caller shuts the deployment down)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass


class GatewayDeployment:
    """The gateway's Serve deployment; Serve turns `engines` (bound deployments) into handles."""

    def __init__(self, room: int, options: dict, *engines) -> None:
        clients = [_HandleClient(handle) for handle in engines]
        self.asgi = gateway_app(Gateway(clients, room), **options)


def _gateway_asgi():
    """serve.ingress's app builder. Serve calls it when the replica starts, without arguments; the app
    needs the handles the constructor received, so it reaches that instance at each request."""
    from ray import serve

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":  # nothing to start: the gateway holds no resources of its own
            return await _lifespan(receive, send)
        await serve.get_replica_context().servable_object.asgi(scope, receive, send)

    return app


async def _lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


class _HandleClient:
    """A gateway.ReplicaClient over a Serve handle to one engine deployment."""

    def __init__(self, handle) -> None:
        self.handle = handle

    async def forward(self, request: Forwarded):
        from ray.exceptions import RayActorError

        stream = self.handle.options(stream=True).forward.remote(request)
        try:
            async for item in stream:
                yield item
        except RayActorError as e:  # died or unreachable; ActorUnavailableError is one too
            raise ReplicaGone(str(e)) from None
        finally:
            stream.cancel()  # a no-op once it has ended; otherwise the replica stops the request

    async def metrics(self) -> str:
        from ray.exceptions import RayActorError

        try:
            return await self.handle.metrics.remote()
        except RayActorError as e:
            raise ReplicaGone(str(e)) from None
