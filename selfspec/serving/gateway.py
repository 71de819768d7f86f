"""The HTTP front of a replicated deployment: one app with the single server's endpoints, which forwards
each request to an engine replica (replica.py) chosen by the router (routing.py), and answers /metrics
itself with every replica's metrics merged. It only parses a request's body enough to name its prefix:
validation, errors, streaming and back-pressure all come from the replica's own app, byte for byte.

Failures it handles: a replica that answers 429 (its queue is full) or dies before it has answered is
skipped for the next in the router's order, so a request is retried while nothing of it has reached the
client; a replica that dies mid-stream ends the stream with an error chunk in OpenAI's shape, as the
single server does for any error after the 200."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.background import BackgroundTask

from .auth import ApiKeyAuth, protected_paths
from .limits import BodyLimit, Limits
from .protocol import SSE_DONE, ApiError, error_body, error_response, sse
from .replica import Forwarded
from .replica_metrics import merge
from .routing import Router, prefix_text

METRICS_TIMEOUT_S = 5.0  # a replica that cannot report within this is shown as down
PROBE_INTERVAL_S = 1.0  # how often a replica that failed is asked whether it is back


class ReplicaGone(Exception):
    """The replica died or became unreachable (Ray restarts it)."""


class ReplicaClient(Protocol):
    """How the gateway reaches one replica (replicas.py adapts a Ray Serve handle to this)."""

    def forward(self, request: Forwarded) -> AsyncIterator: ...  # raises ReplicaGone while iterated

    async def metrics(self) -> str: ...


class Gateway:
    def __init__(self, replicas: list[ReplicaClient], room: int) -> None:
        self.replicas = replicas
        self.router = Router(len(replicas), room)
        self.registry = CollectorRegistry()
        self.routed = Counter(
            "selfspec_router_requests",
            "Requests sent to each replica, by why it was chosen (affinity: it holds the prefix; "
            "least_loaded: no prefix, or its preferred replica was busy or down; retry: an earlier one "
            "answered 429 or failed)",
            ["replica", "route"],
            registry=self.registry,
        )
        self.failures = Counter(
            "selfspec_router_replica_failures",
            "Replicas found dead or unreachable",
            ["replica"],
            registry=self.registry,
        )
        in_flight = Gauge(
            "selfspec_router_in_flight",
            "Requests the gateway has sent to each replica and not yet seen finish (the router's load)",
            ["replica"],
            registry=self.registry,
        )
        down = Gauge(
            "selfspec_router_replica_down",
            "1 while the router skips a replica that failed, until it answers again",
            ["replica"],
            registry=self.registry,
        )
        for i in range(len(replicas)):  # read from the router at each scrape
            in_flight.labels(str(i)).set_function(lambda i=i: self.router.in_flight[i])
            down.labels(str(i)).set_function(lambda i=i: float(self.router.down[i]))
        self._probes: set[asyncio.Task] = set()  # held: the event loop keeps only weak references to tasks

    async def handle(self, request: Request) -> Response:
        forwarded = Forwarded(
            request.method,
            request.url.path,
            request.scope.get("query_string", b""),
            [(k, v) for k, v in request.scope["headers"] if k != b"host"],
            await request.body(),
        )
        order, route = self.router.order(prefix_text(forwarded.body) if forwarded.method == "POST" else None)
        busy: Response | None = None
        for attempt, i in enumerate(order):
            response = await self._try(i, forwarded, route if attempt == 0 else "retry")
            if response is not None and response.status_code != 429:
                return response
            busy = busy or response  # None: replica i is gone; either way the next one may serve it
        return busy or error_response(_unavailable())

    async def _try(self, i: int, forwarded: Forwarded, route: str) -> Response | None:
        """Replica i's response once its start (status and headers) has arrived, the body streaming on;
        None when the replica died before it answered."""
        self.routed.labels(str(i), route).inc()
        self.router.started(i)
        chunks = self.replicas[i].forward(forwarded)
        try:
            status, headers = await anext(chunks)
            if status == 429:  # a small JSON body: read it whole, so that the next replica can be tried
                body = b"".join([c async for c in chunks])
                self.router.finished(i)
                return _response(body, status, headers)
        except ReplicaGone:
            self._failed(i)
            self.router.finished(i)
            return None
        except BaseException:  # cancelled (the client left) or a bug: the replica's work stops too
            self.router.finished(i)
            await chunks.aclose()
            raise
        upstream = _Upstream(self, i, chunks)
        # background: also releases a stream whose body was never started (its client left at once)
        response = StreamingResponse(
            upstream.body(headers), status_code=status, background=BackgroundTask(upstream.close)
        )
        response.raw_headers = headers
        return response

    def _failed(self, i: int) -> None:
        self.failures.labels(str(i)).inc()
        if not self.router.down[i]:
            self.router.failed(i)
            self._probes.add(asyncio.get_running_loop().create_task(self._probe(i)))

    async def _probe(self, i: int) -> None:
        """Marks replica i up again once it answers (Ray restarts a dead replica within seconds, or
        minutes for a large model: its requests go elsewhere until then, rather than queue for it)."""
        try:
            while await self._replica_metrics(self.replicas[i]) is None:
                await asyncio.sleep(PROBE_INTERVAL_S)
            self.router.recovered(i)
        finally:
            self._probes.discard(asyncio.current_task())

    async def metrics(self) -> Response:
        texts = await asyncio.gather(*(self._replica_metrics(r) for r in self.replicas))
        for i, text in enumerate(texts):
            if text is not None and self.router.down[i]:
                # It answered, so it is back, whatever its probe is still waiting on: a probe's call can
                # outlive the replica it was sent to (seen once in a full-suite run: the replica up, the
                # router still skipping it a minute later).
                self.router.recovered(i)
        body = merge({str(i): text for i, text in enumerate(texts)}, self.registry)
        return Response(body, media_type="text/plain; version=0.0.4")

    @staticmethod
    async def _replica_metrics(replica: ReplicaClient) -> str | None:
        try:
            return await asyncio.wait_for(replica.metrics(), METRICS_TIMEOUT_S)
        except Exception:  # gone, restarting (Ray queues the call: the timeout), or any other failure
            return None


class _Upstream:
    """The rest of one replica's response, and its release: the router's count ends and the replica's
    stream is closed exactly once, whether the body ran out, failed, or was never read."""

    def __init__(self, gateway: Gateway, replica: int, chunks: AsyncIterator) -> None:
        self.gateway, self.replica, self.chunks = gateway, replica, chunks
        self.closed = False

    async def body(self, headers: list) -> AsyncIterator[bytes]:
        streaming = any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
        try:
            async for chunk in self.chunks:
                yield chunk
        except ReplicaGone:
            self.gateway._failed(self.replica)
            if streaming:  # the 200 is out: the error can only travel as a chunk, as on the single server
                e = _unavailable()
                yield sse(error_body(e.message, e.kind, e.param, e.code)).encode()
                yield SSE_DONE.encode()
        finally:
            await self.close()

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.gateway.router.finished(self.replica)
            await self.chunks.aclose()


def _response(body: bytes, status: int, headers: list) -> Response:
    response = Response(body, status)
    response.raw_headers = headers  # the replica's own, content-length included
    return response


def _unavailable() -> ApiError:
    return ApiError(
        503,
        "the engine replica serving this request failed: retry",
        code="replica_unavailable",
        kind="server_error",
        headers={"Retry-After": "1"},
    )


def gateway_app(
    gateway: Gateway,
    *,
    max_body_bytes: int = Limits.max_body_bytes,
    api_key: str | None = None,
    protect: tuple[str, ...] = (),
) -> FastAPI:
    """The gateway's ASGI app: /metrics here, every other path forwarded (the replica's app answers
    unknown paths and methods with its OpenAI-shaped 404/405). Body limit and API key are checked here,
    before the body travels to a replica."""
    protected_paths(protect)
    app = FastAPI(title="selfspec", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway

    @app.get("/metrics")
    async def metrics(request: Request):
        return await request.app.state.gateway.metrics()

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
    async def forward(request: Request):
        return await request.app.state.gateway.handle(request)

    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(Exception, _internal_error)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key:  # outermost: a request without the key never gets its body read
        app.add_middleware(ApiKeyAuth, api_key=api_key, protect=tuple(protect))
    return app


async def _api_error(_: Request, e: ApiError):
    return error_response(e)


async def _internal_error(_: Request, e: Exception):
    # as on the single server: OpenAI's shape, not a plain-text 500 (Starlette still logs the traceback)
    return error_response(ApiError(500, f"internal error: {type(e).__name__}", kind="server_error"))
