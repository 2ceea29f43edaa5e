"""Prefill/decode disaggregation: one prefill and one decode worker per request, chosen independently.

Both get the same body plus bootstrap_host/port/room (so the decode side can pull the KV cache from the
prefill side); the client gets the decode response. Each side's in-flight count covers its own leg.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from .policies import RequestInfo
from .proxy import UpstreamUnreachable, forward_headers, json_error, open_upstream, with_fields
from .request_info import batch_size
from .workers import Worker

if TYPE_CHECKING:
    from .app import Router

logger = logging.getLogger("sglang_lite.router")


def bootstrap_fields(body: dict, prefill: Worker, room_of) -> dict:
    """bootstrap_host/port/room; lists of them for a batched /generate (one room per prompt)."""
    server = prefill.server
    n = batch_size(body)
    if n is None:
        return {"bootstrap_host": server.host, "bootstrap_port": server.bootstrap_port, "bootstrap_room": room_of()}
    return {"bootstrap_host": [server.host] * n, "bootstrap_port": [server.bootstrap_port] * n,
            "bootstrap_room": [room_of() for _ in range(n)]}


def leg_payload(raw: bytes, fields: dict, worker: Worker) -> bytes:
    """The client's bytes plus the bootstrap fields (and this leg's DP rank)."""
    rank = {} if worker.dp_rank is None else {"routed_dp_rank": worker.dp_rank}
    return with_fields(raw, {**fields, **rank})


async def forward_pd(router: Router, request: web.Request, raw: bytes, body: dict,
                     info: RequestInfo) -> web.StreamResponse:
    prefill, decode = router.pick("prefill", info), router.pick("decode", info)
    if prefill is None or decode is None:
        return json_error(503, "no healthy prefill or decode worker available", retry_after=1)
    fields = bootstrap_fields(body, prefill, lambda: router.rng.getrandbits(63))
    prefill.acquire()
    leg = asyncio.create_task(_prefill_leg(router, request, prefill, leg_payload(raw, fields, prefill)))
    router.background.add(leg)
    leg.add_done_callback(router.background.discard)
    try:
        return await router.send(request, decode, leg_payload(raw, fields, decode), add_rank=False)
    except UpstreamUnreachable as exc:
        router.record_outcome(decode, failed=True)
        return json_error(502, f"decode worker {decode.server.url} unreachable: {exc}")
    except asyncio.CancelledError:
        leg.cancel()  # the client left: abort the prefill too
        raise


async def _prefill_leg(router: Router, request: web.Request, worker: Worker, payload: bytes) -> None:
    """Send to the prefill worker and drain its response; its in-flight count ends with that response."""
    url = worker.server.url + request.rel_url.path_qs
    failed = True
    try:
        upstream = await open_upstream(router.session, "POST", url, payload, forward_headers(request.headers),
                                       router.config.request_timeout_secs)
        async with upstream:
            await upstream.read()
            failed = upstream.status >= 500
    except asyncio.CancelledError:
        failed = False  # aborted because the client left; not the worker's fault
        raise
    except (UpstreamUnreachable, aiohttp.ClientError, asyncio.TimeoutError) as exc:
        logger.warning("prefill leg on %s failed: %r", worker.server.url, exc)
    finally:
        worker.release()
        router.record_outcome(worker, failed)
