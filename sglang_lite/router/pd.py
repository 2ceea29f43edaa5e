"""Prefill/decode disaggregation: one prefill and one decode worker per request, chosen independently.

Both get the same body plus bootstrap_host/port/room (so the decode side can pull the KV cache from the
prefill side); the client gets the decode response. Each side's in-flight count covers its own leg.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

import aiohttp
from aiohttp import web

from .dispatch import Dispatcher, rank_fields, record_outcome
from .policies import RequestInfo
from .proxy import SHED_STATUSES, UpstreamUnreachable, WorkerShed, json_error, with_fields
from .request_info import batch_size
from .workers import Worker

logger = logging.getLogger("sglang_lite.router")

# (role, request) -> a worker of that role, or None
PickWorker = Callable[[str, RequestInfo], Worker | None]


def bootstrap_fields(body: dict, prefill: Worker, room_of: Callable[[], int]) -> dict:
    """bootstrap_host/port/room; lists of them for a batched /generate (one room per prompt)."""
    server = prefill.server
    n = batch_size(body)
    if n is None:
        return {
            "bootstrap_host": server.host,
            "bootstrap_port": server.bootstrap_port,
            "bootstrap_room": room_of(),
        }
    return {
        "bootstrap_host": [server.host] * n,
        "bootstrap_port": [server.bootstrap_port] * n,
        "bootstrap_room": [room_of() for _ in range(n)],
    }


def leg_payload(raw: bytes, fields: dict, worker: Worker) -> bytes:
    """The client's bytes plus the bootstrap fields (and this leg's DP rank)."""
    return with_fields(raw, {**fields, **rank_fields(worker)})


class PDForwarder:
    """Sends each request to a prefill and a decode worker and returns the decode response.

    The prefill leg runs as a task of its own that may outlive the handler; the forwarder keeps those tasks
    and cancels them on close(). Workers come from `pick`; bootstrap rooms are random 63-bit ids from `rng`.
    """

    def __init__(self, pick: PickWorker, dispatcher: Dispatcher, rng: random.Random) -> None:
        self.pick = pick
        self.dispatcher = dispatcher
        self.rng = rng
        self.prefill_legs: set[asyncio.Task] = set()

    async def forward(
        self, request: web.Request, raw: bytes, body: dict, info: RequestInfo
    ) -> web.StreamResponse:
        prefill, decode = self.pick("prefill", info), self.pick("decode", info)
        if prefill is None or decode is None:
            return json_error(503, "no healthy prefill or decode worker available", retry_after=1)
        fields = bootstrap_fields(body, prefill, lambda: self.rng.getrandbits(63))
        leg = self._start_prefill_leg(request, prefill, leg_payload(raw, fields, prefill))
        try:
            return await self.dispatcher.send(request, decode, leg_payload(raw, fields, decode))
        # no retries in PD mode: the decode worker's answer goes back, Retry-After too
        except WorkerShed as shed:
            leg.cancel()
            return shed.response
        except UpstreamUnreachable as exc:
            record_outcome(decode, failed=True)
            return json_error(502, f"decode worker {decode.server.url} unreachable: {exc}")
        except asyncio.CancelledError:
            leg.cancel()  # the client left: abort the prefill too
            raise

    async def close(self) -> None:
        legs = list(self.prefill_legs)
        for leg in legs:
            leg.cancel()
        await asyncio.gather(*legs, return_exceptions=True)

    def _start_prefill_leg(
        self, request: web.Request, worker: Worker, payload: bytes
    ) -> asyncio.Task:
        worker.acquire()  # counted from dispatch, before the task first runs
        leg = asyncio.create_task(self._prefill_leg(request, worker, payload))
        self.prefill_legs.add(leg)
        leg.add_done_callback(self.prefill_legs.discard)
        return leg

    async def _prefill_leg(self, request: web.Request, worker: Worker, payload: bytes) -> None:
        """Send to the prefill worker and drain its response; its in-flight count ends with that response."""
        failed = True
        try:
            upstream = await self.dispatcher.open(request, worker, payload)
            async with upstream:
                await upstream.read()
                shed = upstream.status in SHED_STATUSES and "Retry-After" in upstream.headers
                failed = upstream.status >= 500 and not shed  # load shedding is not a failure
        except asyncio.CancelledError:
            failed = False  # aborted because the client left; not the worker's fault
            raise
        except (UpstreamUnreachable, aiohttp.ClientError, asyncio.TimeoutError) as exc:
            logger.warning("prefill leg on %s failed: %r", worker.server.url, exc)
        finally:
            worker.release()
            record_outcome(worker, failed)
