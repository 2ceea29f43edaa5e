"""End to end: a real router process in front of two real sglang_lite servers with dp-size 2 each (`dp_pair`,
served model names s0 and s1, shared by the session). What a test checks is what a user can see: response bodies,
the servers' /metrics routing counters and /v1/loads, and the router's /workers."""

from __future__ import annotations

import asyncio
import statistics

import aiohttp
import pytest

from .helpers import (
    chat_streams,
    delta,
    finish_reason,
    generate,
    get_json,
    get_text,
    in_flight,
    parse_counter,
    paused,
    routed,
    run,
    scheduler_pids,
    server_idle,
    wait_for,
)

FAST = ["--worker-startup-check-interval", "0.1", "--health-check-interval-secs", "0.5"]


@pytest.fixture
def idle_pair(dp_pair):
    """The shared servers with nothing left running from an earlier test."""

    async def all_idle():
        async with aiohttp.ClientSession() as s:
            return await wait_for(lambda: _all_idle(s, dp_pair), timeout=20, interval=0.2)

    assert run(all_idle()), "a server still runs requests of an earlier test"
    return dp_pair


async def _all_idle(s: aiohttp.ClientSession, servers) -> bool:
    return all([await server_idle(s, u.url) for u in servers])


def test_dp_aware_routing_spreads_over_all_four_ranks_and_keeps_bodies(procs, idle_pair):
    router = procs.router(
        "--worker-urls", *[u.url for u in idle_pair], "--dp-aware", "--policy", "round_robin", *FAST
    )

    async def scenario():
        async with aiohttp.ClientSession() as s:
            direct = await generate(s, idle_pair[0].url, max_new_tokens=2)
            before = [await routed(s, u.url, how="named") for u in idle_pair]
            results = await asyncio.gather(
                *(generate(s, router.url, max_new_tokens=2) for _ in range(40))
            )
            after = [await routed(s, u.url, how="named") for u in idle_pair]
            workers = (await get_json(s, router.url + "/workers"))["workers"]
        return direct, results, [delta(a, b) for a, b in zip(after, before)], workers

    direct, results, per_rank, workers = run(scenario())
    assert [w["url"] for w in workers] == [f"{u.url}@{r}" for u in idle_pair for r in (0, 1)]
    # each server ran ten requests on each rank, on the rank the router named (routed_dp_rank)
    assert per_rank == [{0: 10, 1: 10}, {0: 10, 1: 10}]
    assert all(r.ok for r in results), [r for r in results if not r.ok][:3]
    assert sorted(r.body["meta_info"]["dp_rank"] for r in results) == [0] * 20 + [1] * 20
    # The body reached the servers intact: same prompt, same sampling parameters, so the same greedy tokens.
    assert {tuple(r.body["output_ids"]) for r in results} == {tuple(direct.body["output_ids"])}
    assert all(
        r.body["meta_info"]["prompt_tokens"] == direct.body["meta_info"]["prompt_tokens"]
        for r in results
    )


def test_load_monitor_sees_per_rank_tokens(procs, idle_pair):
    router = procs.router(
        "--worker-urls",
        *[u.url for u in idle_pair],
        "--dp-aware",
        "--policy",
        "power_of_two",
        "--p2c-load-metric",
        "tokens",
        *FAST,
    )
    target = f"{idle_pair[0].url}@1"

    async def scenario():
        async with aiohttp.ClientSession() as s:

            async def seen():
                workers = (await get_json(s, router.url + "/workers"))["workers"]
                return {w["url"]: w["polled_tokens"] for w in workers}

            assert await wait_for(lambda: _all_polled(seen), timeout=5), await seen()
            idle = await seen()
            # Long generations straight to rank 1 of the first server: only that rank carries tokens.
            busy = [asyncio.create_task(_direct(s, idle_pair[0].url, rank=1)) for _ in range(3)]
            try:
                assert await wait_for(lambda: _positive(seen, target), timeout=20), await seen()
                tokens = await seen()
            finally:
                for t in busy:
                    t.cancel()  # the client hangs up: the server aborts them
                await asyncio.gather(*busy, return_exceptions=True)
            released = await wait_for(
                lambda: server_idle(s, idle_pair[0].url), timeout=20, interval=0.2
            )
            return idle, tokens, released

    idle, tokens, released = run(scenario())
    assert set(idle.values()) == {0}, idle
    assert all(v == 0 for k, v in tokens.items() if k != target), tokens
    assert (
        tokens[target] >= 3
    )  # three prompts of at least one token, plus what was generated so far
    assert released


async def _all_polled(seen) -> bool:
    return None not in (await seen()).values()


async def _positive(seen, target) -> bool:
    return ((await seen()).get(target) or 0) > 0


async def _direct(s: aiohttp.ClientSession, base: str, rank: int) -> None:
    body = {
        "text": "x",
        "sampling_params": {"max_new_tokens": 900, "ignore_eos": True},
        "routed_dp_rank": rank,
    }
    async with s.post(base + "/generate", json=body) as resp:
        await resp.read()


def test_in_flight_returns_to_zero_after_streams_complete_fail_or_are_abandoned(procs, idle_pair):
    urls = [u.url for u in idle_pair]
    router = procs.router("--worker-urls", *urls, "--dp-aware", "--policy", "round_robin", *FAST)
    # The same servers behind a router with a 0.3 s request timeout: long streams fail with an error event (a
    # stream of the context's ~1000 tokens takes over half a second even on an idle fast host).
    strict = procs.router(
        "--worker-urls",
        *urls,
        "--dp-aware",
        "--policy",
        "round_robin",
        "--request-timeout-secs",
        "0.3",
        *FAST,
    )

    async def scenario():
        async with aiohttp.ClientSession() as s:
            # 1. complete: 16 streams are counted while they run, four on each rank. The servers' schedulers are
            # stopped while the streams are sent, so all 16 are in flight together however fast the host is.
            pids = [pid for u in urls for pid in await scheduler_pids(s, u)]
            seen: list[dict[str, int]] = []
            with paused(pids):
                streams = chat_streams(s, router.url, 16)
                counted = await wait_for(lambda: _total(s, router.url, 16, seen), timeout=20)
            assert counted, seen[-3:]
            during = seen[-1]
            results = await asyncio.gather(*streams)
            assert all(r.ok and finish_reason(r) == "length" for r in results), results[:2]
            assert sum(during.values()) == 16 and set(during.values()) == {4}, during
            assert await wait_for(lambda: _all_zero(s, router.url), timeout=3)

            # 2. abandoned: read one event and hang up; the router releases and the servers abort the requests.
            aborts = [await _aborted(s, u) for u in urls]
            await asyncio.gather(*(_abandon(s, router.url) for _ in range(8)))
            assert await wait_for(lambda: _all_zero(s, router.url), timeout=3), await in_flight(
                s, router.url
            )
            assert await wait_for(lambda: _all_idle(s, idle_pair), timeout=10, interval=0.2)
            aborted = [await _aborted(s, u) - n for u, n in zip(urls, aborts)]

            # 3. fail: streams that outlive the router's request timeout end with an error event. From the first
            # stream's first event the schedulers stop until the router's timeout has cut all four, so none can
            # finish its ~1000 tokens first however fast the host is.
            firsts = [asyncio.Event() for _ in range(4)]
            streams = [
                asyncio.create_task(
                    generate(
                        s, strict.url, stream=True, max_new_tokens=3000, timeout=10, first_event=e
                    )
                )
                for e in firsts
            ]
            assert await wait_for(lambda: _started(firsts, streams), timeout=10, interval=0.002)
            with paused(pids):
                failed = await asyncio.gather(*streams)
            released = await wait_for(lambda: _all_zero(s, strict.url), timeout=3)
            stopped = await wait_for(lambda: _all_idle(s, idle_pair), timeout=10, interval=0.2)
            return aborted, failed, released, stopped

    aborted, failed, released, stopped = run(scenario())
    assert aborted == [4, 4], aborted  # round robin: two abandoned requests per rank
    # a 504 if the head was late, else a final error event; either way within the timeout
    assert all(
        (r.status == 504 or "mid-stream" in (r.error or "")) and r.elapsed < 5 for r in failed
    ), failed
    assert released and stopped


async def _started(firsts: list[asyncio.Event], streams: list[asyncio.Task]) -> bool:
    return any(e.is_set() or t.done() for e, t in zip(firsts, streams))


async def _total(s: aiohttp.ClientSession, url: str, n: int, seen: list[dict[str, int]]) -> bool:
    seen.append(await in_flight(s, url))
    return sum(seen[-1].values()) == n


async def _aborted(s: aiohttp.ClientSession, server_url: str) -> int:
    metrics = await get_text(s, server_url + "/metrics")
    return int(
        sum(parse_counter(metrics, "sglang_lite_requests_finished_total", reason="abort").values())
    )


async def _abandon(s: aiohttp.ClientSession, url: str) -> None:
    body = {
        "text": "bye",
        "sampling_params": {"max_new_tokens": 500, "ignore_eos": True},
        "stream": True,
    }
    async with s.post(url + "/generate", json=body) as resp:
        await resp.content.readline()
        resp.close()  # drop the connection mid-stream


async def _all_zero(s: aiohttp.ClientSession, url: str) -> bool:
    return set((await in_flight(s, url)).values()) == {0}


def test_openai_routes_models_errors_and_metrics(procs, dp_pair):
    router = procs.router(
        "--worker-urls", *[u.url for u in dp_pair], "--policy", "cache_aware", *FAST
    )

    async def scenario():
        async with aiohttp.ClientSession() as s:
            replies = []
            for route in ("/v1/completions", "/v1/chat/completions"):
                for stream in (False, True):
                    replies.append(
                        (
                            route,
                            stream,
                            await generate(s, router.url, route, stream=stream, max_new_tokens=3),
                        )
                    )
            models = await get_json(s, router.url + "/v1/models")
            async with s.post(router.url + "/generate", data=b"{not json") as resp:
                bad = (resp.status, await resp.json())
            metrics = await get_text(s, router.url + "/metrics")
        return replies, models, bad, metrics

    replies, models, bad, metrics = run(scenario())
    for route, stream, r in replies:
        assert r.ok and finish_reason(r) == "length" and r.model in ("s0", "s1"), (route, stream, r)
        if not stream:
            assert r.body["usage"]["completion_tokens"] == 3
    assert models["data"][0]["id"] == "s0"  # the first healthy worker answers
    assert bad[0] == 400 and "not valid JSON" in bad[1]["error"]["message"]
    assert 'sglang_router_requests_total{route="/v1/chat/completions",status="200"} 2' in metrics
    assert (
        "sglang_router_worker_in_flight{worker=" in metrics
        and "sglang_router_worker_breaker_state" in metrics
    )
    assert 'sglang_router_request_duration_seconds_count{route="/v1/completions"} 2' in metrics


def test_api_key_and_admission_limits(procs):
    # a stand-in that takes 10 ms a token: the two admitted requests hold their slots for at least 3 s however fast
    # the machine is (a real server's 300 tokens took under the queue timeout on a fast one)
    up = procs.upstream(token_delay=0.01)
    router = procs.router(
        "--worker-urls",
        up.url,
        "--policy",
        "random",
        "--api-key",
        "sekrit",
        "--max-concurrent-requests",
        "2",
        "--queue-size",
        "2",
        "--queue-timeout-secs",
        "1",
        *FAST,
    )
    auth = {"Authorization": "Bearer sekrit"}

    async def scenario():
        async with aiohttp.ClientSession() as s:
            denied = await generate(s, router.url)
            # 2 run (300 tokens: at least 3 s, over the 1 s queue timeout), 2 queue and time out -> 503, the rest
            # are shed at once -> 429
            results = await asyncio.gather(
                *(
                    generate(s, router.url, max_new_tokens=300, headers=auth, timeout=60)
                    for _ in range(8)
                )
            )
            after = await generate(s, router.url, max_new_tokens=1, headers=auth)
            async with s.get(router.url + "/health") as health:
                health_status = health.status
        return denied, results, after, health_status

    denied, results, after, health_status = run(scenario())
    assert denied.status == 401 and health_status == 200 and after.ok
    assert sorted(r.status for r in results) == [200, 200, 429, 429, 429, 429, 503, 503]
    assert all(r.body["meta_info"]["completion_tokens"] == 300 for r in results if r.status == 200)


def test_add_and_remove_worker(procs, dp_pair):
    a, b = dp_pair
    router = procs.router("--worker-urls", a.url, "--policy", "round_robin", *FAST)
    route = "/v1/chat/completions"

    async def scenario():
        async with aiohttp.ClientSession() as s:
            async with s.post(router.url + "/add_worker", params={"url": b.url}) as resp:
                assert resp.status == 200
            both = {
                (await generate(s, router.url, route, max_new_tokens=1)).model for _ in range(4)
            }
            async with s.post(router.url + "/remove_worker", params={"url": a.url}) as resp:
                assert resp.status == 200
            only_b = {
                (await generate(s, router.url, route, max_new_tokens=1)).model for _ in range(4)
            }
            async with s.post(router.url + "/remove_worker", params={"url": a.url}) as resp:
                missing = resp.status
            listed = await get_json(s, router.url + "/list_workers")
        return both, only_b, missing, listed

    both, only_b, missing, listed = run(scenario())
    assert (
        both == {"s0", "s1"} and only_b == {"s1"} and missing == 404 and listed == {"urls": [b.url]}
    )


def test_streaming_time_to_first_token_matches_direct(procs):
    # The stand-in on purpose: this measures what the router adds to a few milliseconds, and a real server's
    # prefill time varies by more than that on a loaded CPU, which would hide (or fake) a 40 ms Nagle stall.
    up = procs.upstream(token_delay=0.03)
    router = procs.router("--worker-urls", up.url, "--policy", "round_robin", *FAST)

    async def scenario():
        async with aiohttp.ClientSession() as s:
            direct, routed_ttft = [], []
            for _ in range(8):
                direct.append((await generate(s, up.url, stream=True, max_new_tokens=2)).ttft)
                routed_ttft.append(
                    (await generate(s, router.url, stream=True, max_new_tokens=2)).ttft
                )
        return statistics.median(direct), statistics.median(routed_ttft)

    direct, routed_ttft = run(scenario())
    # A Nagle stall would add ~40 ms; allow a few ms for the extra hop.
    assert routed_ttft - direct < 0.01, (direct, routed_ttft)


# a context long enough that a generation outlasts the 1 s timeout however fast the engine is (900 tokens of
# the 1024-token context took 0.97 s once)
LONG_CONTEXT = ("--context-length", "8192", "--max-total-tokens", "16384")


def test_client_errors_do_not_trip_the_breaker_and_timeouts_release(procs):
    (server,) = procs.servers(["long"], extra=LONG_CONTEXT)
    router = procs.router(
        "--worker-urls",
        server.url,
        "--policy",
        "round_robin",
        "--cb-failure-threshold",
        "2",
        "--request-timeout-secs",
        "1",
        *FAST,
    )

    async def scenario():
        async with aiohttp.ClientSession() as s:
            bad = [await generate(s, router.url, max_new_tokens=-1) for _ in range(5)]
            good = await generate(s, router.url, max_new_tokens=2)
            # many seconds of tokens against 1 s
            slow = await generate(s, router.url, max_new_tokens=8000)
            slow_stream = await generate(s, router.url, stream=True, max_new_tokens=8000)
            workers = (await get_json(s, router.url + "/workers"))["workers"]
            stopped = await wait_for(lambda: server_idle(s, server.url), timeout=10, interval=0.2)
        return bad, good, slow, slow_stream, workers, stopped

    bad, good, slow, slow_stream, workers, stopped = run(scenario())
    assert [r.status for r in bad] == [400] * 5 and "max_new_tokens" in bad[0].body["error"][
        "message"
    ]
    assert (
        good.ok
    )  # with a breaker threshold of 2, the five 400s before it would otherwise have opened it
    assert slow.status == 504 and slow.elapsed < 3
    assert slow_stream.error is not None and slow_stream.elapsed < 3
    assert workers[0]["in_flight"] == 0 and workers[0]["errors"] == 2
    assert stopped  # the router dropped the connections, so the server aborted both


def test_dp_aware_routing_over_a_dp_attention_server(procs):
    """One world of two ranks whose attention runs data-parallel (DP ranks 0 and 1 meet in every MoE): the router
    sees two DP ranks in /v1/loads, names one per request, and both serve."""
    (server,) = procs.servers(
        ["dpa"],
        dp_size=2,
        extra=("--tp-size", "2", "--enable-dp-attention", "--cpu-threads-per-rank", "1"),
    )
    router = procs.router(
        "--worker-urls", server.url, "--dp-aware", "--policy", "round_robin", *FAST
    )

    async def scenario():
        async with aiohttp.ClientSession() as s:
            results = await asyncio.gather(
                *(generate(s, router.url, max_new_tokens=3) for _ in range(8))
            )
            workers = (await get_json(s, router.url + "/workers"))["workers"]
        return results, workers

    results, workers = run(scenario())
    assert [w["url"] for w in workers] == [f"{server.url}@0", f"{server.url}@1"]
    assert all(r.ok for r in results), [r for r in results if not r.ok][:3]
    assert sorted(r.body["meta_info"]["dp_rank"] for r in results) == [0] * 4 + [1] * 4
