"""Request size limits: the body (checked by an ASGI middleware before the app reads any of it) and
the chat messages and prompt text inside it (checked before tokenizing)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .protocol import ApiError, error_response

MiB = 1 << 20
CHARS_PER_TOKEN = 32  # English averages ~4.5 characters per token


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 4 * MiB
    max_messages: int = 1024  # chat messages in one request
    # characters in one chat message or completion prompt; None: CHARS_PER_TOKEN x the context length,
    # ~7x what an average text of that many tokens holds, so that a text far too long for the context
    # is refused before minutes of tokenizing
    max_message_chars: int | None = None
    max_n: int = 16  # choices per request

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_messages", "max_message_chars", "max_n"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value}: use >= 1")

    def for_context(self, max_model_len: int) -> Limits:
        """These limits with max_message_chars resolved against the engine's context length."""
        return replace(self, max_message_chars=self.max_message_chars or CHARS_PER_TOKEN * max_model_len)

    def check_text(self, text: str, param: str) -> None:
        if len(text) > self.max_message_chars:
            raise ApiError(
                400, f"{param} has {len(text)} characters; the limit is {self.max_message_chars}", param, "too_long"
            )

    def check_messages(self, contents: list[str]) -> None:
        if len(contents) > self.max_messages:
            raise ApiError(
                400,
                f"messages holds {len(contents)} messages; the limit is {self.max_messages}",
                "messages",
                "too_long",
            )
        for i, content in enumerate(contents):
            self.check_text(content, f"messages.{i}.content")


class BodyLimit:
    """Answers 413 as soon as Content-Length, or the bytes of a chunked body received so far, exceed
    max_bytes, without reading the rest (the connection is closed after the 413). Otherwise it reads
    the whole body and replays it to the app; the app reads it all before answering anyway, and this
    way no handler ever holds more than max_bytes of one request."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            return await self._too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its whole body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._too_large(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = ApiError(
            413,
            f"the request body exceeds {self.max_bytes} bytes",
            code="request_too_large",
            headers={"Connection": "close"},  # the unread rest of the body must not be parsed as a request
        )
        await error_response(error)(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP layer rejects a malformed Content-Length before the app sees it
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands out the buffered body once, then the real receive's messages (so the app
    still learns of a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
