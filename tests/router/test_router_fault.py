"""Fault test: one of three servers dies during a bounded run of several hundred requests, then comes back."""
from __future__ import annotations

import asyncio
import time

import aiohttp

from .conftest import start_upstream
from .helpers import generate, get_json, run, wait_for

HEALTH = ["--health-check-interval-secs", "0.2", "--health-failure-threshold", "2", "--health-success-threshold", "1",
          "--cb-failure-threshold", "3", "--cb-timeout-duration-secs", "1", "--retry-max-retries", "3",
          "--retry-initial-backoff-ms", "10", "--request-timeout-secs", "5", "--worker-startup-check-interval", "0.1"]
DETECTION_SECS = 0.2 * 2 + 0.5  # failure threshold x interval, plus a probe timeout's worth of slack
TOTAL, CONCURRENCY, TIMEOUT = 400, 16, 5.0


def test_killed_server_is_avoided_requests_fail_over_and_it_rejoins(procs):
    ups = [procs.upstream(token_delay=0.01, name=f"s{i}") for i in range(3)]
    victim = ups[1]
    router = procs.router("--worker-urls", *[u.url for u in ups], "--policy", "round_robin", *HEALTH)

    async def scenario():
        async with aiohttp.ClientSession() as s:
            results: list[tuple[float, object]] = []  # (start time, result)
            queue = iter(range(TOTAL))
            kill_at: list[float] = []

            async def client() -> None:
                for i in queue:
                    if i == TOTAL // 4 and not kill_at:
                        victim.kill()  # SIGKILL: in-flight connections are reset
                        kill_at.append(time.monotonic())
                    start = time.monotonic()
                    r = await generate(s, router.url, stream=i % 2 == 0, max_new_tokens=8, timeout=TIMEOUT + 2)
                    results.append((start, r))

            async def selections_after_detection() -> int:
                while not kill_at:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(kill_at[0] + DETECTION_SECS - time.monotonic())
                return await _selections(s, router.url, victim.url)

            monitor = asyncio.create_task(selections_after_detection())
            await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
            assert monitor.done(), "the run ended before the detection window; make it longer"
            return results, kill_at[0], monitor.result(), await _selections(s, router.url, victim.url)

    results, killed, selections_detected, selections_end = run(scenario())
    assert selections_end == selections_detected, "the router kept sending to the dead server"

    assert len(results) == TOTAL
    assert all(r.elapsed < TIMEOUT + 1 for _, r in results), "a request hung past the timeout"
    failed = [(t, r) for t, r in results if not r.ok]
    # Only requests already on the victim when it died may fail; they were dispatched before the kill.
    assert len(failed) <= CONCURRENCY and all(t <= killed for t, _ in failed), failed
    assert all(r.ok for t, r in results if t > killed)
    assert len(failed) >= 1  # the kill landed mid-run, so some request was on the victim

    async def after():
        async with aiohttp.ClientSession() as s:
            workers = (await get_json(s, router.url + "/workers"))["workers"]
            state = {w["url"]: w for w in workers}[victim.url]
            assert not state["healthy"]
            # Stopped sending: more requests, no new selections of the victim.
            before = await _selections(s, router.url, victim.url)
            rs = await asyncio.gather(*(generate(s, router.url, max_new_tokens=2) for _ in range(30)))
            assert all(r.ok for r in rs) and await _selections(s, router.url, victim.url) == before
            # Restarted on the same port, it rejoins within the success threshold.
            procs.procs.append(start_upstream(token_delay=0.01, port=victim.port, name="s1-again"))
            assert await wait_for(lambda: _healthy(s, router.url, victim.url), timeout=DETECTION_SECS + 2)
            names = {(await generate(s, router.url, max_new_tokens=1)).upstream for _ in range(9)}
            return names

    assert run(after()) == {"s0", "s1-again", "s2"}


async def _selections(s: aiohttp.ClientSession, router_url: str, base: str) -> int:
    workers = (await get_json(s, router_url + "/workers"))["workers"]
    return sum(w["selections"] for w in workers if w["base_url"] == base)


async def _healthy(s: aiohttp.ClientSession, router_url: str, base: str) -> bool:
    workers = (await get_json(s, router_url + "/workers"))["workers"]
    return all(w["healthy"] for w in workers if w["base_url"] == base)
