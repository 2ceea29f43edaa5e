"""One dispatch to one worker: its in-flight count, the upstream exchange, and the breaker's verdict.

Shared by the plain forwarding (with retries, in app.py) and the PD forwarder (pd.py); it knows neither.
"""
from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from .proxy import forward_headers, json_error, open_upstream, relay
from .workers import Worker


def rank_fields(worker: Worker) -> dict:
    """The body field that routes to the worker's DP rank; none for a worker without one."""
    return {} if worker.dp_rank is None else {"routed_dp_rank": worker.dp_rank}


def record_outcome(worker: Worker, failed: bool) -> None:
    # 4xx is the client's fault and 2xx/3xx a success: only transport failures and 5xx trip the breaker.
    if failed:
        worker.errors += 1
        worker.server.breaker.record_failure(time.monotonic())
    else:
        worker.server.breaker.record_success()


class Dispatcher:
    """Sends a client's request to a worker over one HTTP session, each request bounded by `timeout_secs`."""

    def __init__(self, session: aiohttp.ClientSession, timeout_secs: float) -> None:
        self.session = session
        self.timeout_secs = timeout_secs

    async def send(self, request: web.Request, worker: Worker, payload: bytes | None) -> web.StreamResponse:
        """Relay the worker's response; its in-flight count covers the dispatch until the response body ends.

        Raises UpstreamUnreachable when the request never reached the worker (the caller may retry elsewhere).
        """
        worker.acquire()
        try:
            return await self._exchange(request, worker, payload)
        finally:
            worker.release()

    async def open(self, request: web.Request, worker: Worker, payload: bytes | None) -> aiohttp.ClientResponse:
        """Send `payload` with the client's method, path and headers; returns once the response head arrives."""
        url = worker.server.url + request.rel_url.path_qs
        return await open_upstream(self.session, request.method, url, payload, forward_headers(request.headers),
                                   self.timeout_secs)

    async def _exchange(self, request: web.Request, worker: Worker, payload: bytes | None) -> web.StreamResponse:
        try:
            upstream = await self.open(request, worker, payload)
        except asyncio.TimeoutError:
            record_outcome(worker, failed=True)
            return json_error(504, f"request timed out after {self.timeout_secs}s")
        except aiohttp.ClientError as exc:  # reached the worker, then failed: not safe to retry
            record_outcome(worker, failed=True)
            return json_error(502, f"worker {worker.server.url} failed: {exc!r}")
        try:
            resp, failed = await relay(request, upstream)
        except BaseException:
            upstream.close()  # client gone or cancelled: drop the upstream connection so the worker aborts too
            raise
        upstream.release()
        record_outcome(worker, failed or upstream.status >= 500)
        return resp
