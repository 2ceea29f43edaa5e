"""Prefill/decode disaggregation: one prefill and one decode worker per request, chosen independently.

Both get the same body plus bootstrap_host/port/room (so the decode side can pull the KV cache from the
prefill side); the client gets the decode response. Each side's in-flight count covers its own leg.

A prefill leg that fails (an error status, an error event in its stream, an unreachable worker) fails its decode
request at once, through the decode worker's ``/abort_request`` by room (400 when the prefill refused the request,
else 502), instead of leaving it to wait for a transfer that will not come. A 502 of either worker is the PD pair's
failure (the other side, or the transfer between them), not that worker's: it does not count against its breaker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Callable
from typing import NamedTuple

import aiohttp
from aiohttp import web

from .dispatch import Dispatcher, rank_fields, record_outcome
from .policies import RequestInfo
from .proxy import (
    SHED_STATUSES,
    UpstreamUnreachable,
    WorkerShed,
    forward_headers,
    json_error,
    with_fields,
)
from .request_info import batch_size
from .workers import Worker

logger = logging.getLogger("sglang_lite.router")

# (role, request) -> a worker of that role, or None
PickWorker = Callable[[str, RequestInfo], Worker | None]
# what a PD server answers when its pair (or the transfer between them) failed the request: protocol/outputs.py's
# PD_FAILURE, which the router cannot import (it imports no torch)
PD_FAILURE = 502
ABORT_TIMEOUT_S = 10.0  # the call that fails a decode request whose prefill leg failed


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
        rooms = fields["bootstrap_room"]
        failed_leg = _FailedLeg(request, decode, rooms if isinstance(rooms, list) else [rooms])
        leg = self._start_prefill_leg(
            request, prefill, leg_payload(raw, fields, prefill), failed_leg
        )
        try:
            return await self.dispatcher.send(
                request, decode, leg_payload(raw, fields, decode), excused=_pair_failure
            )
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
        self, request: web.Request, worker: Worker, payload: bytes, failed_leg: _FailedLeg
    ) -> asyncio.Task:
        worker.acquire()  # counted from dispatch, before the task first runs
        leg = asyncio.create_task(self._prefill_leg(request, worker, payload, failed_leg))
        self.prefill_legs.add(leg)
        leg.add_done_callback(self.prefill_legs.discard)
        return leg

    async def _prefill_leg(
        self, request: web.Request, worker: Worker, payload: bytes, failed_leg: _FailedLeg
    ) -> None:
        """Send to the prefill worker and drain its response; its in-flight count ends with that response. A
        failed leg fails its decode request."""
        failed = True
        failure: tuple[int, str] | None = None
        # the prefill side will write nothing for it: refused, shed, or its rank died
        settled = False
        try:
            upstream = await self.dispatcher.open(request, worker, payload)
            async with upstream:
                data = await upstream.read()
                shed = upstream.status in SHED_STATUSES and "Retry-After" in upstream.headers
                # load shedding and the pair's own failures are not this worker's
                failed = upstream.status >= 500 and not shed and upstream.status != PD_FAILURE
                failure = leg_failure(upstream.status, data)
                # refused (4xx), shed or failed by its rank's death (503, also as a stream's error event)
                settled = failure is not None and (
                    failure[0] in SHED_STATUSES or 400 <= failure[0] < 500
                )
        except asyncio.CancelledError:
            failed = False  # aborted because the client left; not the worker's fault
            raise
        except (UpstreamUnreachable, aiohttp.ClientError, asyncio.TimeoutError) as exc:
            logger.warning("prefill leg on %s failed: %r", worker.server.url, exc)
            failure = (PD_FAILURE, f"unreachable or failed mid-response: {exc!r}")
        finally:
            worker.release()
            record_outcome(worker, failed)
        if failure is not None:
            status, message = failure
            why = f"the prefill server {worker.server.url} failed the request ({status}): {message}"
            status = 400 if 400 <= status < 500 else PD_FAILURE
            await self._fail_decode(failed_leg, status, why, settled)

    async def _fail_decode(self, leg: _FailedLeg, status: int, message: str, settled: bool) -> None:
        """Fails the decode requests of ``leg``'s rooms on their worker (it answers their clients)."""
        url = leg.decode.server.url + "/abort_request"
        headers = forward_headers(leg.request.headers, self.dispatcher.worker_key)
        headers = {
            k: v for k, v in headers.items() if k.lower() not in ("content-length", "content-type")
        }
        body = {
            "bootstrap_room": leg.rooms,
            "error": message[:4096],
            "status_code": status,
            "settled": settled,
        }
        try:
            async with self.dispatcher.session.post(
                url,
                json=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S),
            ) as response:
                await response.read()
                if response.status != 200:
                    logger.warning("decode worker %s refused the abort: %d", url, response.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            logger.warning("could not fail the decode request on %s: %r", url, exc)


class _FailedLeg(NamedTuple):
    """What fails a decode request whose prefill leg failed."""

    request: web.Request
    decode: Worker
    rooms: list[int]


def _pair_failure(status: int) -> bool:
    return status == PD_FAILURE


def leg_failure(status: int, data: bytes) -> tuple[int, str] | None:
    """(status, message) of a prefill answer that did not prefill: an error status, or an error event in a 200
    stream (its rank died mid-request); None for an answer that did."""
    if status == 200 and b'"error"' not in data:
        return None
    text = data.decode("utf-8", "replace")
    for line in [text] + [ln[len("data:") :] for ln in text.splitlines() if ln.startswith("data:")]:
        try:
            parsed = json.loads(line)
        except ValueError:
            continue
        error = parsed.get("error") if isinstance(parsed, dict) else None
        if error is not None:
            message = error.get("message") if isinstance(error, dict) else error
            code = error.get("code") if isinstance(error, dict) else None
            code = code if isinstance(code, int) and 400 <= code < 600 else status
            return (code if status == 200 else status), str(message)[:1000]
    return None if status == 200 else (status, text[:1000])
