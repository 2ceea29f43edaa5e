"""Forwarding: request bodies, retries on another worker, and the chunk-by-chunk response relay."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web

logger = logging.getLogger("sglang_lite.router")

# Hop-by-hop headers (RFC 9110) plus those aiohttp recomputes; everything else passes through both ways.
_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)


# a relayed event stream's response carries when its first event went out (perf_counter), for the router's TTFT
FIRST_EVENT_AT = "first_event_at"
SHED_STATUSES = (429, 503)
MAX_SHED_BODY = 64 * 1024  # a shedding answer is a small, complete JSON error
# the server's words for a dead rank
DEAD_RANK = re.compile(r"\bDP rank (\d+) (?:is not alive|died)")


class UpstreamUnreachable(Exception):
    """The request never reached the worker (connection refused or failed): safe to retry elsewhere."""


@dataclass(eq=False)
class WorkerShed(Exception):
    """The worker refused the request before doing anything for the client: it shed load (429/503 with
    Retry-After) or named one of its DP ranks dead. Safe to retry elsewhere; `response` is what the client gets
    when no other worker takes it (the worker's status, body and Retry-After)."""

    response: web.Response
    retry_after: float | None
    dead_rank: int | None


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def forward_headers(headers, worker_key: str | None = None) -> dict[str, str]:
    """The client's end-to-end headers; with a worker key, its Authorization is replaced by the worker key."""
    out = {k: v for k, v in headers.items() if k.lower() not in _HOP}
    if worker_key:
        out = {k: v for k, v in out.items() if k.lower() != "authorization"} | bearer(worker_key)
    return out


def with_fields(raw: bytes, fields: dict) -> bytes:
    """Append routing fields to a JSON object body, leaving every other byte as the client sent it.

    Appended keys come last, so they win over a client's own copy in JSON parsers that keep the last duplicate
    (Python's json, orjson, serde_json with the default map behaviour of the servers we front).
    """
    if not fields:
        return raw
    body = raw.rstrip()
    assert body.endswith(b"}"), "routing fields can only be added to a JSON object"
    extra = json.dumps(fields, separators=(",", ":")).encode()[1:-1]
    inner_empty = body[:-1].rstrip().endswith(b"{")
    return body[:-1] + (b"" if inner_empty else b",") + extra + b"}"


def json_error(status: int, message: str, retry_after: int | None = None) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.json_response(
        {"error": {"message": message, "code": status}}, status=status, headers=headers
    )


def backoff_secs(attempt: int, cfg, rng: random.Random) -> float:
    base = cfg.retry_initial_backoff_ms * cfg.retry_backoff_multiplier**attempt
    delay = min(base, cfg.retry_max_backoff_ms) / 1000.0
    return delay * (1.0 + cfg.retry_jitter_factor * (2.0 * rng.random() - 1.0))


async def open_upstream(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    payload: bytes | None,
    headers: dict[str, str],
    timeout: float,
) -> aiohttp.ClientResponse:
    """Send a request and wait for the response head; connection failures become UpstreamUnreachable."""
    try:
        return await session.request(
            method, url, data=payload, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
        )
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamUnreachable(str(exc)) from exc


def may_be_shed(upstream: aiohttp.ClientResponse) -> bool:
    """A small complete 429/503 that may be load shedding or a dead rank (read its body to be sure)."""
    size = upstream.content_length
    return (
        upstream.status in SHED_STATUSES
        and not is_event_stream(upstream)
        and size is not None
        and size <= MAX_SHED_BODY
    )


def retry_after_secs(value: str | None) -> float | None:
    """Retry-After in seconds (HTTP dates are not used by the servers we front: treated as absent)."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def shed_of(upstream: aiohttp.ClientResponse, body: bytes) -> WorkerShed | None:
    """The shedding verdict on a read 429/503: Retry-After present, or the body names a dead DP rank."""
    retry_after = retry_after_secs(upstream.headers.get("Retry-After"))
    match = DEAD_RANK.search(body.decode("utf-8", "replace")) if upstream.status == 503 else None
    if retry_after is None and match is None:
        return None
    response = web.Response(body=body, status=upstream.status, headers=_response_headers(upstream))
    return WorkerShed(response, retry_after, int(match.group(1)) if match else None)


def _response_headers(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}


def is_event_stream(upstream: aiohttp.ClientResponse) -> bool:
    return upstream.headers.get("Content-Type", "").startswith("text/event-stream")


async def relay(
    request: web.Request, upstream: aiohttp.ClientResponse
) -> tuple[web.StreamResponse, bool]:
    """Pass the upstream response to the client; returns (response, upstream_failed).

    Event streams go out chunk by chunk as they arrive (aiohttp sets TCP_NODELAY on both sockets, so a small
    chunk is not held back by Nagle's algorithm). A failure after the head was sent becomes a final SSE error
    event, so the client sees an error instead of a silently truncated stream.
    """
    # a sized body: one read
    if not is_event_stream(upstream) and upstream.content_length is not None:
        try:
            data = await upstream.read()
        except asyncio.TimeoutError:
            return json_error(
                504, "request timed out while the worker was sending the response"
            ), True
        except aiohttp.ClientError as exc:
            return json_error(502, f"worker failed while sending the response: {exc!r}"), True
        return web.Response(
            body=data, status=upstream.status, headers=_response_headers(upstream)
        ), False
    resp = web.StreamResponse(status=upstream.status, headers=_response_headers(upstream))
    await resp.prepare(request)
    failed = await _pump(resp, upstream, whole_events=is_event_stream(upstream))
    await resp.write_eof()
    return resp, failed


async def _pump(
    resp: web.StreamResponse, upstream: aiohttp.ClientResponse, whole_events: bool
) -> bool:
    """Copies the body as it arrives. An event stream goes out in whole events (a chunk may end inside one), so a
    failure drops the half-received event and the error event that follows stands on its own."""
    pending = b""
    try:
        async for chunk in upstream.content.iter_any():
            pending += chunk
            cut = _after_last_event(pending) if whole_events else len(pending)
            if cut:
                await resp.write(pending[:cut])
                pending = pending[cut:]
                if whole_events and FIRST_EVENT_AT not in resp:
                    resp[FIRST_EVENT_AT] = time.perf_counter()
        if pending:
            await resp.write(pending)
        return False
    except (
        aiohttp.ClientPayloadError,
        aiohttp.ServerDisconnectedError,
        aiohttp.ClientOSError,
        asyncio.TimeoutError,
    ) as exc:
        error = {"error": {"message": f"upstream failed mid-stream: {exc!r}", "code": 502}}
        await resp.write(b"data: " + json.dumps(error).encode() + b"\n\n")
        return True


def _after_last_event(data: bytes) -> int:
    """Where the last complete SSE event in ``data`` ends; 0 when none does."""
    end = data.rfind(b"\n\n")
    return end + 2 if end >= 0 else 0
