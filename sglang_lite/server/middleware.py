"""ASGI middleware: the API key, the request body limit, the bound on requests in progress, and per-route
request counts."""

from __future__ import annotations

import hmac
import json
from typing import Any

from sglang_lite.server.metrics import ServerMetrics
from sglang_lite.server.responses import error_body

Scope = dict[str, Any]


async def _reply(
    send: Any, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = json.dumps(error_body(status, message)).encode()
    base = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": base + (headers or [])})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope.get("headers", []) if k.lower() == name), None)


class ApiKeyMiddleware:
    """``Authorization: Bearer <key>`` on every path but the open ones."""

    def __init__(self, app: Any, api_key: str, open_paths: tuple[str, ...]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = _header(scope, b"authorization") or b""
            if not hmac.compare_digest(given, self.expected):
                await _reply(
                    send,
                    401,
                    "missing or wrong API key (Authorization: Bearer <key>)",
                    [(b"www-authenticate", b"Bearer")],
                )
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads the whole body first (requests are small JSON) and refuses one over the limit with 413."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _reply(send, 413, f"request body over {self.max_bytes} bytes")
            return
        body = await self._read(receive)
        if body is None:
            await _reply(send, 413, f"request body over {self.max_bytes} bytes")
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Any) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"".join(chunks)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return None
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Any) -> Any:
    sent = False

    async def replayed() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


class ConcurrencyLimitMiddleware:
    """At most ``max_requests`` HTTP requests in progress (a stream until its last event); beyond it 503 with
    Retry-After, at once and before the body is read. The exempt paths (health, loads, metrics) always answer, so
    a router and a monitor can still see a saturated server."""

    def __init__(self, app: Any, max_requests: int, exempt_paths: tuple[str, ...]) -> None:
        self.app = app
        self.max_requests = max_requests
        self.exempt_paths = exempt_paths
        self.active = 0

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt_paths:
            await self.app(scope, receive, send)
            return
        if self.active >= self.max_requests:
            await _reply(
                send,
                503,
                f"the server is handling {self.active} requests, its limit; retry later",
                [(b"retry-after", b"1")],
            )
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


class RouteCountMiddleware:
    """Counts responses by route and status (unknown paths count as "other", so labels stay few)."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics
        self._known: set[str] | None = None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self._paths(scope) else "other"

        async def counted(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http_requests[route, message["status"]] += 1
            await send(message)

        await self.app(scope, receive, counted)

    def _paths(self, scope: Scope) -> set[str]:
        if self._known is None:
            self._known = {getattr(r, "path", "") for r in scope["app"].router.routes}
        return self._known
