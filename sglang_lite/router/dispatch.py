"""One dispatch to one worker: its in-flight count, the upstream exchange, and the breaker's verdict.

Shared by the plain forwarding (with retries, in app.py) and the PD forwarder (pd_router.py); it knows neither.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp
from aiohttp import web

from .proxy import (
    WorkerShed,
    forward_headers,
    json_error,
    may_be_shed,
    open_upstream,
    relay,
    shed_of,
)
from .workers import Worker

logger = logging.getLogger("sglang_lite.router")
# how long a rank named dead by a response is skipped when the server gives no Retry-After
DEAD_RANK_SECS = 5.0


def rank_fields(worker: Worker) -> dict:
    """The body field that routes to the worker's DP rank; none for a worker without one."""
    return {} if worker.dp_rank is None else {"routed_dp_rank": worker.dp_rank}


def record_shed(worker: Worker, shed: WorkerShed) -> None:
    """Shedding is not a failure: the breaker is left alone. A rank named dead is skipped for a while (until its
    Retry-After; the health checker's per-rank probes decide for longer), the rest of its server stays in use."""
    worker.sheds += 1
    if shed.dead_rank is None:
        return
    target = next((w for w in worker.server.workers if w.dp_rank == shed.dead_rank), None)
    if target is not None:
        logger.warning(
            "worker %s reports DP rank %d dead; skipping that rank",
            worker.server.url,
            shed.dead_rank,
        )
        target.mark_rank_down(time.monotonic(), shed.retry_after or DEAD_RANK_SECS)


def record_outcome(worker: Worker, failed: bool) -> None:
    # 4xx is the client's fault and 2xx/3xx a success: only transport failures and 5xx trip the breaker.
    if failed:
        worker.errors += 1
        worker.server.breaker.record_failure(time.monotonic())
    else:
        worker.server.breaker.record_success()


class Dispatcher:
    """Sends a client's request to a worker over one HTTP session, each request bounded by `timeout_secs`."""

    def __init__(
        self, session: aiohttp.ClientSession, timeout_secs: float, worker_key: str | None = None
    ) -> None:
        self.session = session
        self.timeout_secs = timeout_secs
        self.worker_key = worker_key  # replaces the client's Authorization when set

    async def send(
        self,
        request: web.Request,
        worker: Worker,
        payload: bytes | None,
        excused: Callable[[int], bool] | None = None,
    ) -> web.StreamResponse:
        """Relay the worker's response; its in-flight count covers the dispatch until the response body ends.
        ``excused``: the statuses that are not the worker's failure (PD: its pair's).

        Raises UpstreamUnreachable when the request never reached the worker, WorkerShed when the worker shed it
        (in both cases nothing was sent to the client, and the caller may retry elsewhere).
        """
        worker.acquire()
        try:
            return await self._exchange(request, worker, payload, excused)
        finally:
            worker.release()

    async def open(
        self, request: web.Request, worker: Worker, payload: bytes | None
    ) -> aiohttp.ClientResponse:
        """Send `payload` with the client's method, path and headers; returns once the response head arrives."""
        url = worker.server.url + request.rel_url.path_qs
        headers = forward_headers(request.headers, self.worker_key)
        return await open_upstream(
            self.session, request.method, url, payload, headers, self.timeout_secs
        )

    async def _exchange(
        self,
        request: web.Request,
        worker: Worker,
        payload: bytes | None,
        excused: Callable[[int], bool] | None,
    ) -> web.StreamResponse:
        try:
            upstream = await self.open(request, worker, payload)
        except asyncio.TimeoutError:
            record_outcome(worker, failed=True)
            return json_error(504, f"request timed out after {self.timeout_secs}s")
        except aiohttp.ClientError as exc:  # reached the worker, then failed: not safe to retry
            record_outcome(worker, failed=True)
            return json_error(502, f"worker {worker.server.url} failed: {exc!r}")
        if may_be_shed(upstream):
            await self._raise_if_shed(worker, upstream)
        try:
            resp, failed = await relay(request, upstream)
        except BaseException:
            upstream.close()  # client gone or cancelled: drop the upstream connection so the worker aborts too
            raise
        upstream.release()
        excuse = excused is not None and excused(upstream.status)
        record_outcome(worker, (failed or upstream.status >= 500) and not excuse)
        return resp

    async def _raise_if_shed(self, worker: Worker, upstream: aiohttp.ClientResponse) -> None:
        """Read a small 429/503 whole; raise WorkerShed if it is shedding (else it is relayed from the buffer)."""
        try:
            body = await upstream.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return  # relay() meets the same error and reports it
        shed = shed_of(upstream, body)
        if shed is not None:
            upstream.release()
            record_shed(worker, shed)
            raise shed
