"""PD under its own faults (issue 49), behind our router (``--dp-aware``), with clients sending greedy requests all
the while: a decode rank stopped past the prefill side's write deadline (its blocks time out while under way), the
prefill server's scheduler killed, a decode rank killed.

Each checks that every answer that completed equals transformers (no request read KV that a late write overwrote),
that every failure is a clean HTTP error in bounded time (the router fails a decode request whose prefill leg
failed at once, instead of its waiting for the transfer timeout), that the cluster serves fresh requests correctly
after the fault, and that every PD queue drains. Every wait is bounded; the fixture kills every process.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.tools.pd_faults import (
    Load,
    healthy,
    kill_rank,
    scheduler_pids,
    stop_for,
    verdicts,
    wait_for,
)

from .conftest import free_port, wait_until_healthy
from .pd_helpers import drained, pd_router
from .test_pd_disagg import PROMPTS, Checkpoint, server

TIMEOUT_S = 20  # --disaggregation-transfer-timeout: the prefill side's write deadline is half of it
CLIENTS = 6
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
RESTART_S = 120.0  # a killed rank's restart on two busy cores
# a request failed by the fault must end well within the transfer timeout it used to wait out
FAILS_WITHIN_S = TIMEOUT_S / 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A prefill server (dp 1) and a decode server (dp 2) behind our router, and the prompts' references."""
    checkpoint = Checkpoint(str(tmp_path_factory.mktemp("pd_faults")))
    bootstrap = free_port()
    timeout = ("--disaggregation-transfer-timeout", str(TIMEOUT_S))
    prefill = server(
        checkpoint, "prefill", 1, "--disaggregation-bootstrap-port", str(bootstrap), *timeout
    )
    decode = server(checkpoint, "decode", 2, *timeout)
    procs = [prefill, decode]
    try:
        for proc in procs:
            if not wait_until_healthy(proc.url, proc.popen, 180, interval_s=0.25):
                raise RuntimeError(f"a PD server did not start:\n{proc.output()[-3000:]}")
        procs.append(pd_router(prefill.url, bootstrap, decode.url, "--dp-aware"))
        references = [checkpoint.greedy(prompt) for prompt in PROMPTS]
        yield prefill, decode, procs[2], references
    finally:
        for proc in procs:
            proc.kill()


async def quiet(s: aiohttp.ClientSession, *urls: str) -> bool:
    try:
        return await drained(s, *urls)
    except KeyError:  # a rank is down: its loads are an error
        return False


async def under_load(cluster, fault) -> tuple[Load, float, Load, bool]:
    """Clients through the router; ``fault(s)`` (returning when it struck) once a few requests completed, then load
    on until the servers are healthy and every client has finished a request more. Returns the load, when the fault
    struck, a fresh wave (every prompt once), and whether every PD queue then drained."""
    prefill, decode, router, _ = cluster
    async with aiohttp.ClientSession() as s:
        load = Load(router.url, PROMPTS, GREEDY, timeout_s=90)
        clients = [asyncio.create_task(load.client(s, i, CLIENTS)) for i in range(CLIENTS)]
        try:
            assert await wait_for(lambda: load.completed(2 * CLIENTS), timeout=60)
            struck = await fault(s)
            back = await wait_for(lambda: healthy(s, prefill.url, decode.url), timeout=RESTART_S)
            assert back, "a PD server did not come back healthy"
            settled = len(load.outcomes)
            assert await wait_for(lambda: load.completed(settled + CLIENTS), timeout=60)
        finally:
            load.stop.set()
            await asyncio.wait_for(asyncio.gather(*clients, return_exceptions=True), 120)
        fresh = Load(router.url, PROMPTS, GREEDY, timeout_s=90)
        await fresh.every_prompt(s)
        drains = await wait_for(
            lambda: quiet(s, prefill.url, decode.url), timeout=2 * TIMEOUT_S + 30, interval=0.5
        )
        return load, struck, fresh, drains


def check(cluster, load: Load, fresh: Load, drains: bool) -> list:
    """No corrupted answer, only clean errors, fresh requests right, queues drained; returns the failures."""
    seen = verdicts(load.outcomes + fresh.outcomes, cluster[3], hung_s=60)
    assert not seen["corrupted"], seen["corrupted"]
    assert not seen["unclean"], seen["unclean"]
    assert not seen["hung"], seen["hung"]
    assert [o.status for o in fresh.outcomes] == [200] * len(PROMPTS), fresh.outcomes
    assert drains, "a PD queue did not drain"
    return [o for o in load.outcomes if o.status != 200]


def run_fault(cluster, fault):
    return asyncio.run(asyncio.wait_for(under_load(cluster, fault), 600))


def test_a_decode_rank_stopped_past_the_write_deadline(cluster):
    """Its blocks time out under way (the write deadline is half the transfer timeout): the prefill side waits for
    them to end, so the decode side frees no page a block may still land in. Every completed answer is right."""
    _, decode, _, _ = cluster

    async def fault(s: aiohttp.ClientSession) -> float:
        victim = (await scheduler_pids(s, decode.url))[0]
        return await stop_for(victim, TIMEOUT_S / 2 + 3)  # past the write deadline

    load, _, fresh, drains = run_fault(cluster, fault)
    check(cluster, load, fresh, drains)


def test_a_killed_prefill_scheduler_fails_its_decode_legs_at_once(cluster):
    """The decode legs of requests the dead prefill rank held end within half the transfer timeout (the router
    fails them through the decode server), and the decode worker's breaker stays closed: fresh requests pass."""
    prefill, _, _, _ = cluster

    async def fault(s: aiohttp.ClientSession) -> float:
        return await kill_rank(s, prefill.url, 0, RESTART_S)

    load, struck, fresh, drains = run_fault(cluster, fault)
    failures = check(cluster, load, fresh, drains)
    assert failures, "no request was in flight at the kill"
    for o in failures:
        assert o.ended - max(o.started, struck) < FAILS_WITHIN_S, o


def test_a_killed_decode_rank_holds_up_no_other_rank(cluster):
    """The prefill side marks the dead rank's transfer engine down and writes to the other rank on a thread of its
    own: requests on the surviving rank keep finishing, right, and the dead rank's fail at once."""
    _, decode, _, _ = cluster

    async def fault(s: aiohttp.ClientSession) -> float:
        return await kill_rank(s, decode.url, 0, RESTART_S)

    load, struck, fresh, drains = run_fault(cluster, fault)
    for o in check(cluster, load, fresh, drains):
        assert o.ended - max(o.started, struck) < FAILS_WITHIN_S, o
    after = [o for o in load.outcomes if o.started > struck + 1 and o.status == 200]
    assert after, "no request succeeded after the kill: the surviving rank was held up"
