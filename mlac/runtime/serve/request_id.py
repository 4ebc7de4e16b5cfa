"""X-Request-Id, as vLLM's server answers it: every HTTP response carries the header, with the
client's value when it sent a usable one (printable ASCII, at most MAX_CHARS), else a fresh one.
The handlers read it from the request's state (`request_id(request)`); the engine's log lines of
the request name it (stats.py).

A pure ASGI middleware: it adds one header to the response's start message and touches nothing
else, so that streams and the handlers' own view of the connection (a client's disconnect) pass
through unchanged.
"""

from __future__ import annotations

import uuid

HEADER = b"x-request-id"
MAX_CHARS = 256


def _usable(value: bytes) -> bool:
    return 0 < len(value) <= MAX_CHARS and all(0x21 <= b <= 0x7E for b in value)


def given_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The client's X-Request-Id, when it sent a usable one."""
    value = next((v for k, v in headers if k.lower() == HEADER), None)
    return value.decode("ascii") if value is not None and _usable(value) else None


class RequestIdMiddleware:
    """Names every HTTP request (module doc): scope["state"]["request_id"], echoed as X-Request-Id."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = given_id(scope.get("headers", [])) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (HEADER, rid.encode("ascii"))]}
            await send(message)

        return await self.app(scope, receive, send_named)


def request_id(request) -> str:
    """The name the middleware gave `request` (a starlette Request)."""
    return request.scope["state"]["request_id"]
