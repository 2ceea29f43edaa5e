"""Response helpers shared by the native and OpenAI endpoints: error bodies, SSE framing, disconnect watching."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from sglang_lite.server.io_struct import RequestError

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client hung up before its response was ready; its requests were aborted."""


ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    408: "RequestTimeout",
    409: "ConflictError",
    413: "RequestTooLarge",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailable",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    """OpenAI's error shape, which the openai client turns into its exception's message."""
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "ServerError"),
            "code": status,
        }
    }


def error_response(
    status: int, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


def request_error_response(error: RequestError) -> JSONResponse:
    return error_response(error.status, error.message, error.headers)


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def sse_error(error: RequestError) -> bytes:
    """The event that ends a stream whose request failed after the response started."""
    return sse({"error": {"message": error.message, "code": error.status}})


class SSEResponse(StreamingResponse):
    """Server-sent events whose body iterator is always closed, so a client hanging up aborts its requests."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, media_type=self.media_type, headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Awaits ``work``; cancels it (so its streams close and abort) if the client hangs up first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            task.cancel()
            raise ClientDisconnected()
        return task.result()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
