"""A header timeout for uvicorn's h11 protocol. uvicorn arms its keep-alive timer only after a response
and disarms it on any byte received, and none of its Config options bounds how long a client may take
to send a request's headers: a client that sends a partial request line and then trickles (or sends
nothing) holds its connection forever. Measured against uvicorn 0.54: 50 such connections all stayed
open under timeout_keep_alive, limit_concurrency and h11_max_incomplete_event_size alike. This
protocol closes a connection whose next request's headers are not complete `timeout` seconds after
it opened or after its previous response ended."""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderTimeoutH11Protocol(H11Protocol):
    header_timeout: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()  # the next request on this keep-alive connection gets the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_deadline)

    def _disarm_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _header_deadline(self) -> None:
        self._header_timer = None
        # IDLE: no complete request line and headers since the timer was armed (a request in progress,
        # even one uploading its body slowly, has moved h11 past IDLE).
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def header_timeout_protocol(timeout: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class to pass as uvicorn.Config(http=...), with this header timeout."""
    if not timeout > 0:
        raise ValueError(f"header timeout {timeout}: use a number of seconds > 0")
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout": timeout})
