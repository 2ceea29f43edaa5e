"""Fault test: one of three real sglang_lite servers (dp-size 1) is killed during a bounded run of several hundred
requests through the router, then restarted on the same port."""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import aiohttp

from .helpers import (
    Result,
    generate,
    get_json,
    in_flight,
    payload,
    read_events,
    routed,
    run,
    wait_for,
)

HEALTH = [
    "--health-check-interval-secs",
    "0.2",
    "--health-failure-threshold",
    "2",
    "--health-success-threshold",
    "1",
    "--cb-failure-threshold",
    "3",
    "--cb-timeout-duration-secs",
    "1",
    "--retry-max-retries",
    "3",
    "--retry-initial-backoff-ms",
    "10",
    "--request-timeout-secs",
    "5",
    "--worker-startup-check-interval",
    "0.1",
]
DETECTION_SECS = (
    0.2 * 2 + 0.5
)  # failure threshold x interval, plus slack (a refused probe fails at once)
TOTAL, CONCURRENCY, TIMEOUT = 300, 12, 5.0
# The stream the victim is killed under generates as many tokens as the servers' context (1024) leaves room for:
# ~0.35 s alone on a 2-core Zen 3 (200 tokens took 0.08 s, and once every request on the victim had finished
# before the client read the first chunk and killed it, so no request failed).
VICTIM_STREAM_TOKENS = 960
RESTART_SECS = 120.0  # a cold server start on a loaded 2-core host


def test_killed_server_is_avoided_requests_fail_over_and_it_rejoins(procs):
    servers = procs.servers(["s0", "s1", "s2"], dp_size=1)
    victim = servers[1]
    router = procs.router(
        "--worker-urls", *[u.url for u in servers], "--policy", "round_robin", *HEALTH
    )

    async def scenario():
        async with aiohttp.ClientSession() as s:
            results: list[tuple[float, object]] = []  # (start time, result)
            numbers = itertools.count()
            kill_at: list[float] = []

            async def client() -> None:
                # at least TOTAL requests, and on until the detection window has passed, however fast they run
                for i in numbers:
                    if i >= TOTAL and monitor.done():
                        return
                    if i == TOTAL // 4 and not kill_at:
                        # the kill lands while a stream runs on the victim, so the failure path is exercised
                        results.append(
                            await _stream_until_killed(s, router.url, victim, "s1", kill_at)
                        )
                    start = time.monotonic()
                    r = await generate(
                        s, router.url, stream=i % 2 == 0, max_new_tokens=32, timeout=TIMEOUT + 2
                    )
                    results.append((start, r))

            async def selections_after_detection() -> int:
                while not kill_at:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(kill_at[0] + DETECTION_SECS - time.monotonic())
                return await _selections(s, router.url, victim.url)

            monitor = asyncio.create_task(selections_after_detection())
            await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
            released = await wait_for(lambda: _all_zero(s, router.url), timeout=3)
            end = await _selections(s, router.url, victim.url)
            return results, kill_at[0], monitor.result(), end, released

    results, killed, selections_detected, selections_end, released = run(scenario())
    assert selections_end == selections_detected, "the router kept sending to the dead server"
    assert released, "in-flight counts did not return to zero"

    assert len(results) >= TOTAL
    assert all(r.elapsed < TIMEOUT + 1 for _, r in results), "a request hung past the timeout"
    failed = [(t, r) for t, r in results if not r.ok]
    # Only requests already on the victim when it died may fail; they were dispatched before the kill, and they
    # got an error: a 502 before the response head, a final error event after it.
    assert len(failed) <= CONCURRENCY and all(t <= killed for t, _ in failed), failed
    assert all(
        r.status == 502 or (r.status == 200 and "mid-stream" in r.error) for _, r in failed
    ), failed
    assert len(failed) >= 1  # the kill landed mid-run, so some request was on the victim
    assert all(
        r.ok for t, r in results if t > killed
    )  # those that never reached it: retried on the others

    async def after():
        async with aiohttp.ClientSession() as s:
            workers = (await get_json(s, router.url + "/workers"))["workers"]
            state = {w["url"]: w for w in workers}[victim.url]
            assert not state["healthy"]
            # Stopped sending: more requests, no new selections of the victim.
            before = await _selections(s, router.url, victim.url)
            rs = await asyncio.gather(
                *(generate(s, router.url, max_new_tokens=2) for _ in range(30))
            )
            assert all(r.ok for r in rs) and await _selections(s, router.url, victim.url) == before
            # Restarted on the same port, it rejoins within the success threshold once it answers /health.
            await asyncio.to_thread(procs.servers, ["s1-again"], 1, victim.port)
            assert await wait_for(
                lambda: _healthy(s, router.url, victim.url), timeout=DETECTION_SECS + 2
            )
            names = {
                (await generate(s, router.url, "/v1/chat/completions", max_new_tokens=1)).model
                for _ in range(9)
            }
            return names, await routed(s, victim.url)

    names, victim_routed = run_long(after())
    assert names == {"s0", "s1-again", "s2"}
    assert (
        sum(victim_routed.values()) == 3
    )  # round robin over three: its fresh /metrics saw every third request


def run_long(coro):
    """Like helpers.run, with room for a cold server start."""
    return asyncio.run(asyncio.wait_for(coro, 60 + RESTART_SECS))


async def _selections(s: aiohttp.ClientSession, router_url: str, base: str) -> int:
    workers = (await get_json(s, router_url + "/workers"))["workers"]
    return sum(w["selections"] for w in workers if w["base_url"] == base)


async def _healthy(s: aiohttp.ClientSession, router_url: str, base: str) -> bool:
    workers = (await get_json(s, router_url + "/workers"))["workers"]
    return all(w["healthy"] for w in workers if w["base_url"] == base)


async def _all_zero(s: aiohttp.ClientSession, url: str) -> bool:
    return set((await in_flight(s, url)).values()) == {0}


async def _stream_until_killed(
    s: aiohttp.ClientSession, router_url: str, victim, victim_name: str, kill_at: list[float]
) -> tuple[float, Result]:
    """Completion streams through the router until one lands on the victim (each chunk names its server); the
    victim is killed (SIGKILL to its process group) once that stream has started, so it fails mid-stream however
    fast the servers generate. Streams that land elsewhere are closed at their first chunk."""
    body = payload("/v1/completions", True, VICTIM_STREAM_TOKENS, "hello")
    for _ in range(30):
        start, result = time.monotonic(), Result(0)
        try:
            async with s.post(
                router_url + "/v1/completions",
                json=body,
                timeout=aiohttp.ClientTimeout(total=TIMEOUT + 2),
            ) as resp:
                result.status = resp.status
                first = await _first_event(resp)
                if first is None or first.get("model") != victim_name:
                    continue
                victim.kill()
                kill_at.append(time.monotonic())
                result.chunks = 1
                await read_events(resp, result, time.perf_counter())
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            result.error = repr(exc)
        result.elapsed = time.monotonic() - start
        if kill_at:
            return start, result
    raise AssertionError("no completion stream through the router landed on the victim")


async def _first_event(resp: aiohttp.ClientResponse) -> dict | None:
    async for line in resp.content:
        if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
            return json.loads(line[6:])
    return None
