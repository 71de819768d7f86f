"""API-key authentication: `Authorization: Bearer <key>` on /v1/* and on whichever of /health,
/metrics and the API docs the operator protects. Checked from the headers alone, so an unauthenticated
client never gets its body read."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from .protocol import ApiError, error_response

# what --protect may name, and the paths each covers (/v1/* is always protected)
PROTECTABLE = {
    "health": ("/health",),
    "metrics": ("/metrics",),
    "docs": ("/docs", "/redoc", "/openapi.json"),
}


def protected_paths(names: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    unknown = sorted(set(names) - set(PROTECTABLE))
    if unknown:
        raise ValueError(f"cannot protect {', '.join(unknown)}: choose from {', '.join(PROTECTABLE)}")
    return tuple(path for name in names for path in PROTECTABLE[name])


class ApiKeyAuth:
    def __init__(self, app: ASGIApp, api_key: str, protect: tuple[str, ...] = ()) -> None:
        if not api_key:
            raise ValueError("the API key is empty")
        self.app = app
        self.key = api_key.encode()
        self.paths = protected_paths(protect)

    def _protects(self, path: str) -> bool:
        return (
            path == "/v1" or path.startswith("/v1/") or any(path == p or path.startswith(p + "/") for p in self.paths)
        )

    def _authorized(self, scope: Scope) -> bool:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        # compare_digest: the time taken must not reveal how much of a guessed key was right
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._protects(scope["path"]) and not self._authorized(scope):
            error = ApiError(
                401,
                "invalid or missing API key: send it as 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                # close: uvicorn would otherwise read (and discard) whatever body follows
                headers={"WWW-Authenticate": "Bearer", "Connection": "close"},
            )
            return await error_response(error)(scope, receive, send)
        await self.app(scope, receive, send)
