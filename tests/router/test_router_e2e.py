"""End to end: real router process in front of two upstream servers with dp-size 2 each."""
from __future__ import annotations

import asyncio
import statistics

import aiohttp
import pytest

from .helpers import generate, get_json, in_flight, run, wait_for

FAST = ["--worker-startup-check-interval", "0.1", "--health-check-interval-secs", "0.5"]


@pytest.fixture
def dp_pair(procs):
    return [procs.upstream(dp_size=2, token_delay=0.005, name=f"s{i}") for i in range(2)]


def test_dp_aware_routing_spreads_over_all_four_ranks_and_keeps_bodies(procs, dp_pair):
    router = procs.router("--worker-urls", *[u.url for u in dp_pair], "--dp-aware", "--policy", "round_robin", *FAST)

    async def scenario():
        async with aiohttp.ClientSession() as s:
            results = await asyncio.gather(*(generate(s, router.url, max_new_tokens=2) for _ in range(40)))
            assert all(r.ok for r in results)
            stats = [await get_json(s, u.url + "/_stats") for u in dp_pair]
            workers = (await get_json(s, router.url + "/workers"))["workers"]
        return stats, workers

    stats, workers = run(scenario())
    assert [w["url"] for w in workers] == [f"{u.url}@{r}" for u in dp_pair for r in (0, 1)]
    assert [st["by_rank"] for st in stats] == [{"0": 10, "1": 10}, {"0": 10, "1": 10}]
    body = stats[0]["bodies"][0]
    assert body == {"text": "hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}, "stream": False,
                    "routed_dp_rank": body["routed_dp_rank"]}  # unchanged apart from the routing field


def test_load_monitor_sees_per_rank_tokens(procs, dp_pair):
    router = procs.router("--worker-urls", *[u.url for u in dp_pair], "--dp-aware", "--policy", "power_of_two",
                          "--p2c-load-metric", "tokens", *FAST)

    async def scenario():
        async with aiohttp.ClientSession() as s:
            # Long requests straight to rank 1 of the first server: only that rank carries tokens.
            busy = [asyncio.create_task(_direct(s, dp_pair[0].url, rank=1)) for _ in range(3)]
            target = f"{dp_pair[0].url}@1"

            async def seen():
                workers = (await get_json(s, router.url + "/workers"))["workers"]
                return {w["url"]: w["polled_tokens"] for w in workers}

            assert await wait_for(lambda: _positive(seen, target), timeout=5)
            tokens = await seen()
            for t in busy:
                t.cancel()
            await asyncio.gather(*busy, return_exceptions=True)
            return tokens, target

    tokens, target = run(scenario())
    assert all(v == 0 for k, v in tokens.items() if k != target), tokens
    # num_total_tokens of three requests: prompt (1 token each) plus what they generated so far
    assert tokens[target] >= 3


async def _positive(seen, target) -> bool:
    return ((await seen()).get(target) or 0) > 0


async def _direct(s: aiohttp.ClientSession, base: str, rank: int) -> None:
    body = {"text": "x", "sampling_params": {"max_new_tokens": 2000}, "routed_dp_rank": rank}
    async with s.post(base + "/generate", json=body) as resp:
        await resp.read()


def test_in_flight_returns_to_zero_after_streams_complete_fail_or_are_abandoned(procs):
    ups = [procs.upstream(dp_size=2, token_delay=0.02, name=f"s{i}") for i in range(2)]
    router = procs.router("--worker-urls", *[u.url for u in ups], "--dp-aware", "--policy", "round_robin",
                          "--request-timeout-secs", "10", *FAST)

    async def scenario():
        async with aiohttp.ClientSession() as s:
            # 1. complete: 16 streams of 10 tokens (0.2 s each) are counted while they run.
            streams = [asyncio.create_task(generate(s, router.url, "/v1/chat/completions", stream=True,
                                                    max_new_tokens=10)) for _ in range(16)]
            await asyncio.sleep(0.1)
            during = await in_flight(s, router.url)
            results = await asyncio.gather(*streams)
            assert all(r.ok and r.chunks == 11 for r in results)
            assert sum(during.values()) == 16 and set(during.values()) == {4}, during
            assert set((await in_flight(s, router.url)).values()) == {0}

            # 2. abandoned: read one event and hang up; the router releases and aborts upstream too.
            await asyncio.gather(*(_abandon(s, router.url) for _ in range(8)))
            assert await wait_for(lambda: _all_zero(s, router.url), timeout=3)
            aborted = [(await get_json(s, u.url + "/_stats"))["aborted"] for u in ups]
            assert sum(aborted) == 8, aborted

            # 3. fail: the server dies mid-stream; its clients get an error, counts return to zero.
            streams = [asyncio.create_task(generate(s, router.url, stream=True, max_new_tokens=50))
                       for _ in range(8)]
            await asyncio.sleep(0.2)
            ups[1].kill()
            results = await asyncio.gather(*streams)
            assert await wait_for(lambda: _all_zero(s, router.url), timeout=3)
            return results

    results = run(scenario())
    assert sum(r.ok for r in results) == 4 and all("mid-stream" in r.error for r in results if not r.ok)


async def _abandon(s: aiohttp.ClientSession, url: str) -> None:
    body = {"text": "bye", "sampling_params": {"max_new_tokens": 500}, "stream": True}
    async with s.post(url + "/generate", json=body) as resp:
        await resp.content.readline()
        resp.close()  # drop the connection mid-stream


async def _all_zero(s: aiohttp.ClientSession, url: str) -> bool:
    return set((await in_flight(s, url)).values()) == {0}


def test_openai_routes_models_errors_and_metrics(procs, dp_pair):
    router = procs.router("--worker-urls", *[u.url for u in dp_pair], "--policy", "cache_aware", *FAST)

    async def scenario():
        async with aiohttp.ClientSession() as s:
            for route in ("/v1/completions", "/v1/chat/completions"):
                for stream in (False, True):
                    r = await generate(s, router.url, route, stream=stream, max_new_tokens=3)
                    assert r.ok and (r.chunks == 4 if stream else True), (route, stream, r)
            models = await get_json(s, router.url + "/v1/models")
            async with s.post(router.url + "/generate", data=b"{not json") as resp:
                bad = (resp.status, await resp.json())
            async with s.get(router.url + "/metrics") as resp:
                metrics = await resp.text()
        return models, bad, metrics

    models, bad, metrics = run(scenario())
    assert models["data"][0]["id"] == "upstream"
    assert bad[0] == 400 and "not valid JSON" in bad[1]["error"]["message"]
    assert 'sglang_router_requests_total{route="/v1/chat/completions",status="200"} 2' in metrics
    assert "sglang_router_worker_in_flight{worker=" in metrics and "sglang_router_worker_breaker_state" in metrics
    assert 'sglang_router_request_duration_seconds_count{route="/v1/completions"} 2' in metrics


def test_api_key_and_admission_limits(procs):
    up = procs.upstream(token_delay=0.05)
    router = procs.router("--worker-urls", up.url, "--policy", "random", "--api-key", "sekrit",
                          "--max-concurrent-requests", "2", "--queue-size", "2", "--queue-timeout-secs", "0.3", *FAST)
    auth = {"Authorization": "Bearer sekrit"}

    async def scenario():
        async with aiohttp.ClientSession() as s:
            denied = await generate(s, router.url)
            # 2 run, 2 queue, the rest are shed at once with 429; the queued ones time out (0.3 s < 0.5 s) -> 503
            results = await asyncio.gather(*(generate(s, router.url, max_new_tokens=10, headers=auth)
                                             for _ in range(8)))
            async with s.post(router.url + "/generate", json={"text": "x"}, headers=auth) as r:
                pass
            async with s.get(router.url + "/health") as health:
                health_status = health.status
        return denied, results, health_status

    denied, results, health_status = run(scenario())
    assert denied.status == 401 and health_status == 200
    assert sorted(r.status for r in results) == [200, 200, 429, 429, 429, 429, 503, 503]


def test_add_and_remove_worker(procs):
    a, b = procs.upstream(name="a"), procs.upstream(name="b")
    router = procs.router("--worker-urls", a.url, "--policy", "round_robin", *FAST)

    async def scenario():
        async with aiohttp.ClientSession() as s:
            async with s.post(router.url + "/add_worker", params={"url": b.url}) as resp:
                assert resp.status == 200
            both = {(await generate(s, router.url)).upstream for _ in range(4)}
            async with s.post(router.url + "/remove_worker", params={"url": a.url}) as resp:
                assert resp.status == 200
            only_b = {(await generate(s, router.url)).upstream for _ in range(4)}
            async with s.post(router.url + "/remove_worker", params={"url": a.url}) as resp:
                missing = resp.status
            listed = await get_json(s, router.url + "/list_workers")
        return both, only_b, missing, listed

    both, only_b, missing, listed = run(scenario())
    assert both == {"a", "b"} and only_b == {"b"} and missing == 404 and listed == {"urls": [b.url]}


def test_streaming_time_to_first_token_matches_direct(procs):
    up = procs.upstream(token_delay=0.03)
    router = procs.router("--worker-urls", up.url, "--policy", "round_robin", *FAST)

    async def scenario():
        async with aiohttp.ClientSession() as s:
            direct, routed = [], []
            for _ in range(8):
                direct.append((await generate(s, up.url, stream=True, max_new_tokens=2)).ttft)
                routed.append((await generate(s, router.url, stream=True, max_new_tokens=2)).ttft)
        return statistics.median(direct), statistics.median(routed)

    direct, routed = run(scenario())
    # A Nagle stall would add ~40 ms; allow a few ms for the extra hop.
    assert routed - direct < 0.01, (direct, routed)


def test_client_errors_do_not_trip_the_breaker_and_timeouts_release(procs):
    up = procs.upstream(token_delay=0.05)
    router = procs.router("--worker-urls", up.url, "--policy", "round_robin", "--cb-failure-threshold", "2",
                          "--request-timeout-secs", "0.3", *FAST)

    async def scenario():
        async with aiohttp.ClientSession() as s:
            bad = [await generate(s, router.url, max_new_tokens=-1) for _ in range(5)]
            good = await generate(s, router.url, max_new_tokens=2)
            slow = await generate(s, router.url, max_new_tokens=100)  # 5 s of tokens against a 0.3 s timeout
            slow_stream = await generate(s, router.url, stream=True, max_new_tokens=100)
            workers = (await get_json(s, router.url + "/workers"))["workers"]
        return bad, good, slow, slow_stream, workers

    bad, good, slow, slow_stream, workers = run(scenario())
    assert [r.status for r in bad] == [400] * 5 and good.ok
    assert slow.status == 504 and slow.elapsed < 2
    assert slow_stream.error is not None and slow_stream.elapsed < 2
    assert workers[0]["in_flight"] == 0 and workers[0]["errors"] == 2
