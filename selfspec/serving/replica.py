"""One engine replica of a Ray Serve deployment: the single server's app (create_app: the same engine,
scheduler, validation, errors, back-pressure and metrics), driven in-process. The gateway hands it an
HTTP request as plain data; the replica runs it through the app's ASGI interface and streams the
response back: first (status, headers), then the body's chunks as the app sends them. Nothing here
imports Ray: replicas.py makes this class a deployment."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from .server import create_app

CANCEL_GRACE_S = 5.0  # after the gateway goes away, how long the app gets to free the request's blocks


@dataclass(frozen=True)
class Forwarded:
    """An HTTP request as the gateway received it (its body read whole: the gateway's BodyLimit caps it)."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def scope(self) -> dict:
        return {
            "type": "http",
            # spec 2.3: Starlette's StreamingResponse then watches receive() for the disconnect that
            # close() signals, and stops the stream (freeing its KV blocks) as it would under uvicorn
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": self.method,
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode(),
            "root_path": "",
            "query_string": self.query_string,
            "headers": self.headers,
            "client": ("gateway", 0),
            "server": ("replica", 0),
        }


class EngineReplica:
    def __init__(self, make_engine: Callable[[], object], app_options: dict) -> None:
        """make_engine: builds the engine (run here, in the replica's process); app_options: create_app's."""
        self.app = create_app(make_engine(), **app_options)
        # Under uvicorn the app's lifespan starts the scheduler; nothing runs a lifespan here.
        self.app.state.scheduler.start()

    async def forward(self, request: Forwarded) -> AsyncIterator[tuple[int, list] | bytes]:
        """The app's response to `request`: (status, raw headers) first, then body chunks."""
        sent: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()  # set when the gateway stops listening (its client left, or it finished)
        task = asyncio.create_task(self.app(request.scope(), _receive(request.body, gone), sent.put))
        task.add_done_callback(lambda _: sent.put_nowait(None))  # wakes the loop below if the app ends early
        try:
            while (message := await sent.get()) is not None:
                if message["type"] == "http.response.start":
                    yield message["status"], list(message.get("headers", []))
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        return
            task.result()  # the app ended without a complete response: surface its error
        finally:
            gone.set()
            await _finish(task)

    def metrics(self) -> str:
        """This replica's Prometheus text, load gauges fresh (as GET /metrics on the single server)."""
        service = self.app.state.service
        service.metrics.observe_load(service.scheduler)
        return service.metrics.render().decode()

    def __del__(self) -> None:  # Ray Serve calls it when it stops the replica
        with contextlib.suppress(Exception):
            self.app.state.scheduler.stop()
            self.app.state.service.tokenizer_thread.shutdown(wait=False, cancel_futures=True)


def _receive(body: bytes, gone: asyncio.Event):
    """An ASGI receive: the whole body once, then a disconnect when `gone` is set."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if pending:
            return pending.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    return receive


async def _finish(task: asyncio.Task) -> None:
    if task.done():
        return
    try:  # the app sees the disconnect and ends the request itself (cancelling its scheduler work)
        await asyncio.wait_for(asyncio.shield(task), CANCEL_GRACE_S)
    except asyncio.TimeoutError:
        task.cancel()
    except BaseException:
        task.cancel()
        raise
