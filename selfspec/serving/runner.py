"""Running the app under uvicorn, with the connection limits and the graceful shutdown this server
needs. uvicorn's own signal handling closes the listening socket on the first signal, waits for
connections without a time limit, force-quits on a second SIGINT (streams cut without `[DONE]`), and
re-raises the signal once done (SIGTERM: exit -15). Here instead: the first SIGTERM or SIGINT stops
admission (new requests get 503 while the socket stays open), requests in flight get up to
`shutdown_timeout` seconds to finish, and then those left are ended with a final error event; a
second signal only cuts the wait short. The process then exits normally."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading

import uvicorn
from uvicorn.server import HANDLED_SIGNALS

from .connections import header_timeout_protocol
from .server import FINAL_EVENT_GRACE_S

DEFAULT_SHUTDOWN_TIMEOUT = 30.0
DEFAULT_KEEP_ALIVE_TIMEOUT = 5.0  # uvicorn's default
DEFAULT_HEADER_TIMEOUT = 10.0


class GracefulServer(uvicorn.Server):
    """uvicorn's Server with the shutdown of the module docstring: `service` (the app's Service) drains."""

    def __init__(self, config: uvicorn.Config, service, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
        if not shutdown_timeout >= 0:
            raise ValueError(f"shutdown timeout {shutdown_timeout}: use seconds >= 0")
        super().__init__(config)
        self.service, self.shutdown_timeout = service, shutdown_timeout
        self.signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cancel_now = asyncio.Event()
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        # Replaces uvicorn's (see the module docstring). The handler only schedules the real work on the
        # event loop: a signal handler runs between two bytecodes of whatever the main thread was doing.
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only; request_shutdown() still works
            return
        loop = asyncio.get_running_loop()

        def handler(sig, _frame):
            loop.call_soon_threadsafe(self._on_signal, sig)

        previous = {sig: signal.signal(sig, handler) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, original in previous.items():
                signal.signal(sig, original)

    def handle_exit(self, sig, frame) -> None:  # uvicorn's entry point, kept for callers that use it
        self.request_shutdown()

    def request_shutdown(self) -> None:
        """As a SIGTERM would (any thread)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._on_signal, signal.SIGTERM)

    def _on_signal(self, sig: int) -> None:
        self.signals += 1
        if self.signals == 1:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        else:
            self._cancel_now.set()

    async def _drain(self) -> None:
        try:
            await self.service.drain(self.shutdown_timeout, self._cancel_now)
        finally:
            self.should_exit = True  # uvicorn's main loop notices within 0.1 s and shuts down


def make_server(
    app,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT,
    header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    limit_concurrency: int | None = None,
    log_level: str = "warning",
) -> GracefulServer:
    """The uvicorn server for `app` (from create_app). keep_alive_timeout: how long an idle keep-alive
    connection stays open; header_timeout: how long a client may take to send a request's headers;
    limit_concurrency: connections + requests in progress beyond which uvicorn answers 503."""
    if not keep_alive_timeout > 0:
        raise ValueError(f"keep-alive timeout {keep_alive_timeout}: use seconds > 0")
    if limit_concurrency is not None and limit_concurrency < 1:
        raise ValueError(f"limit_concurrency {limit_concurrency}: use >= 1")
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=header_timeout_protocol(header_timeout),
        timeout_keep_alive=keep_alive_timeout,
        limit_concurrency=limit_concurrency,
        # after the drain every response has ended: this only bounds the wait for stuck connections
        timeout_graceful_shutdown=FINAL_EVENT_GRACE_S,
        lifespan="on",
    )
    return GracefulServer(config, app.state.service, shutdown_timeout)
