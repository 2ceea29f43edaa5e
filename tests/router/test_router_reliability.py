"""Reliability of the router (issue 15): a worker's load shedding is not a failure, a dead DP rank takes out only
itself, keyed workers work behind --dp-aware, and the router's own key guards its admin and metrics routes.

Shedding and dead ranks use the stand-in (upstream.py), whose refusals copy a real server's (503 + Retry-After,
"DP rank N is not alive") and which can hold a slot or kill a rank on demand; keyed workers run on a real server
too. Every process is killed at teardown (the procs fixture) and every scenario is bounded by helpers.run.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

from .helpers import generate, get_json, get_text, parse_counter, run, wait_for

FAST = [
    "--worker-startup-check-interval",
    "0.1",
    "--health-check-interval-secs",
    "0.2",
    "--health-failure-threshold",
    "1",
    "--health-success-threshold",
    "1",
]
# A breaker this touchy would open on the second shed if shedding counted as a failure.
TOUCHY = [
    "--cb-failure-threshold",
    "2",
    "--cb-timeout-duration-secs",
    "60",
    "--retry-max-retries",
    "3",
    "--retry-initial-backoff-ms",
    "5",
]


async def _workers(s: aiohttp.ClientSession, router_url: str) -> dict[str, dict]:
    return {w["url"]: w for w in (await get_json(s, router_url + "/workers"))["workers"]}


async def _hold(s: aiohttp.ClientSession, url: str, seconds: float) -> asyncio.Task:
    """Occupy one slot of a stand-in for about `seconds` (token delay 0.05 s), started before this returns."""
    task = asyncio.create_task(
        generate(s, url, max_new_tokens=int(seconds / 0.05), timeout=seconds + 10)
    )

    async def running() -> bool:
        return (await get_json(s, url + "/_stats"))["running"] > 0

    assert await wait_for(running, timeout=5)
    return task


def test_shed_requests_go_elsewhere_or_back_with_retry_after_and_never_open_the_breaker(procs):
    shedding = ["--max-concurrency", "1", "--retry-after", "2"]
    a = procs.upstream(token_delay=0.05, name="a", extra=tuple(shedding))
    b = procs.upstream(token_delay=0.05, name="b", extra=tuple(shedding))
    router = procs.router("--worker-urls", a.url, b.url, "--policy", "round_robin", *TOUCHY, *FAST)

    async def scenario():
        async with aiohttp.ClientSession() as s:
            hold = await _hold(s, a.url, 1.5)  # a is full: whatever the router sends there is shed
            moved = [await generate(s, router.url, max_new_tokens=1) for _ in range(6)]
            await hold
            hold_a, hold_b = (
                await _hold(s, a.url, 1.5),
                await _hold(s, b.url, 1.5),
            )  # no room anywhere
            started = time.monotonic()
            refused = await asyncio.gather(
                *(generate(s, router.url, max_new_tokens=1) for _ in range(4))
            )
            refused_secs = time.monotonic() - started
            await asyncio.gather(hold_a, hold_b)
            after = [
                await generate(s, router.url, max_new_tokens=1) for _ in range(4)
            ]  # no 60 s outage
            return (
                moved,
                refused,
                refused_secs,
                after,
                await _workers(s, router.url),
                await get_text(s, router.url + "/metrics"),
            )

    moved, refused, refused_secs, after, workers, metrics = run(scenario())
    assert all(r.ok and r.upstream == "b" for r in moved), moved  # those a shed were retried on b
    assert workers[a.url]["sheds"] >= 3
    assert all(r.status == 503 and r.retry_after == "2" for r in refused), (
        refused
    )  # the workers' own answer
    assert all("waiting queue is full" in r.body["error"]["message"] for r in refused)
    assert refused_secs < 2, "a refusal should come back at once, not after waiting"
    assert all(r.ok for r in after) and {r.upstream for r in after} == {"a", "b"}
    assert all(
        w["breaker"] == "closed" and w["errors"] == 0 and w["healthy"] for w in workers.values()
    ), workers
    assert parse_counter(metrics, "sglang_router_worker_sheds_total", worker=a.url)
    assert (
        "sglang_router_retries_total" in metrics and "sglang_router_retries_total 0" not in metrics
    )


def test_burst_over_shedding_workers_gets_answers_or_retry_after_and_no_breaker_opens(procs):
    shedding = ("--max-concurrency", "2", "--retry-after", "1")
    ups = [procs.upstream(token_delay=0.02, name=f"u{i}", extra=shedding) for i in range(2)]
    router = procs.router(
        "--worker-urls", *[u.url for u in ups], "--policy", "random", *TOUCHY, *FAST
    )

    async def scenario():
        async with aiohttp.ClientSession() as s:
            burst = await asyncio.gather(
                *(generate(s, router.url, max_new_tokens=5, stream=i % 2 == 0) for i in range(30))
            )
            return burst, await _workers(s, router.url)

    burst, workers = run(scenario())
    statuses = [r.status for r in burst]
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 4, statuses
    assert all(r.ok for r in burst if r.status == 200)  # nothing broken mid-stream
    assert all(r.retry_after == "1" for r in burst if r.status == 503)
    assert (
        sum(w["sheds"] for w in workers.values()) > 2
    )  # more sheds than the threshold of 2, breakers closed
    assert all(w["breaker"] == "closed" and w["errors"] == 0 for w in workers.values()), workers


def test_a_dead_dp_rank_takes_out_only_itself_and_returns(procs):
    up = procs.upstream(dp_size=2, token_delay=0.001)
    router = procs.router(
        "--worker-urls", up.url, "--dp-aware", "--policy", "round_robin", *TOUCHY, *FAST
    )
    rank0, rank1 = f"{up.url}@0", f"{up.url}@1"

    async def scenario():
        async with aiohttp.ClientSession() as s:
            async with s.post(up.url + "/_rank", params={"rank": "1", "alive": "0"}):
                pass
            first = [
                await generate(s, router.url, max_new_tokens=2) for _ in range(6)
            ]  # before any health round

            async def rank1_down() -> bool:
                return not (await _workers(s, router.url))[rank1]["rank_up"]

            down = await wait_for(rank1_down, timeout=3)
            before = (await _workers(s, router.url))[rank1]["selections"]
            during = [await generate(s, router.url, max_new_tokens=2) for _ in range(6)]
            state = await _workers(s, router.url)
            metrics = await get_text(s, router.url + "/metrics")
            async with s.post(up.url + "/_rank", params={"rank": "1", "alive": "1"}):
                pass

            async def rank1_up() -> bool:
                return (await _workers(s, router.url))[rank1]["rank_up"]

            back = await wait_for(rank1_up, timeout=3)
            again = [await generate(s, router.url, max_new_tokens=2) for _ in range(4)]
            return first, down, before, during, state, metrics, back, again

    first, down, before, during, state, metrics, back, again = run(scenario())
    assert all(r.ok and r.body["meta_info"]["dp_rank"] == 0 for r in first + during), first + during
    assert (
        down and state[rank1]["selections"] == before
    )  # once seen dead, the rank is no longer tried
    assert (
        state[rank0]["rank_up"] and state[rank0]["healthy"] and state[rank1]["healthy"]
    )  # the server is in use
    assert all(w["breaker"] == "closed" for w in state.values())
    assert f'sglang_router_worker_healthy{{worker="{rank1}"}} 0' in metrics
    assert f'sglang_router_worker_healthy{{worker="{rank0}"}} 1' in metrics
    assert back and {r.body["meta_info"]["dp_rank"] for r in again} == {0, 1}


def test_router_key_guards_admin_and_metrics_and_the_worker_key_reaches_workers(procs):
    up = procs.upstream(dp_size=2, name="keyed", extra=("--api-key", "worker-key"))
    router = procs.router(
        "--worker-urls",
        up.url,
        "--dp-aware",
        "--policy",
        "power_of_two",
        "--api-key",
        "client-key",
        "--worker-api-key",
        "worker-key",
        *FAST,
    )
    auth = {"Authorization": "Bearer client-key"}

    async def status(s, method: str, path: str, headers=None) -> int:
        async with s.request(
            method, router.url + path, headers=headers, params={"url": "http://127.0.0.1:9"}
        ) as r:
            return r.status

    async def scenario():
        async with aiohttp.ClientSession() as s:
            ok = await generate(s, router.url, headers=auth)
            wrong = await generate(s, router.url, headers={"Authorization": "Bearer client-kez"})
            guarded = {
                p: await status(s, m, p)
                for m, p in (
                    ("GET", "/metrics"),
                    ("GET", "/workers"),
                    ("GET", "/list_workers"),
                    ("POST", "/add_worker"),
                    ("POST", "/remove_worker"),
                )
            }
            opened = {p: await status(s, "GET", p) for p in ("/health", "/liveness", "/readiness")}
            with_key = await status(s, "GET", "/metrics", auth)

            async def polled() -> bool:
                async with s.get(router.url + "/workers", headers=auth) as r:
                    workers = (await r.json())["workers"]
                return all(w["polled_tokens"] is not None for w in workers)

            loads_seen = await wait_for(polled, timeout=3)
            async with s.get(router.url + "/metrics", headers=auth) as r:
                metrics = await r.text()
            return ok, wrong, guarded, opened, with_key, loads_seen, metrics

    ok, wrong, guarded, opened, with_key, loads_seen, metrics = run(scenario())
    assert ok.ok and ok.body["meta_info"]["dp_rank"] in (
        0,
        1,
    )  # the worker took the router's worker key
    assert wrong.status == 401 and set(guarded.values()) == {401}, guarded
    assert set(opened.values()) == {200} and with_key == 200
    assert loads_seen
    assert parse_counter(metrics, "sglang_router_load_poll_failures_total", worker=up.url) == {
        f'worker="{up.url}"': 0.0
    }


def test_a_missing_worker_key_fails_fast_or_is_counted(procs):
    up = procs.upstream(dp_size=2, extra=("--api-key", "worker-key"))
    started = time.monotonic()
    try:
        procs.router("--worker-urls", up.url, "--dp-aware", *FAST)
        raise AssertionError("the router started without the worker key")
    except RuntimeError as exc:
        assert "--worker-api-key" in str(
            exc
        )  # said at once, instead of retrying /server_info for 30 minutes
    assert time.monotonic() - started < 15
    # Without --dp-aware it starts (/health is open) and every failed load poll is counted, not swallowed.
    router = procs.router("--worker-urls", up.url, "--policy", "power_of_two", *FAST)

    async def failures() -> float:
        async with aiohttp.ClientSession() as s:
            metrics = await get_text(s, router.url + "/metrics")
        return sum(
            parse_counter(metrics, "sglang_router_load_poll_failures_total", worker=up.url).values()
        )

    async def counted() -> bool:
        return await failures() >= 3

    assert run(wait_for(counted, timeout=5))
    assert "load poll of" in router.output() and "HTTP 401" in router.output()


def test_keyed_real_server_behind_dp_aware_starts_routes_and_polls(procs):
    (server,) = procs.servers(["keyed"], dp_size=2, extra=("--api-key", "k3y"))
    router = procs.router(
        "--worker-urls",
        server.url,
        "--dp-aware",
        "--policy",
        "power_of_two",
        "--api-key",
        "k3y",
        *FAST,
    )
    auth = {"Authorization": "Bearer k3y"}

    async def scenario():
        async with aiohttp.ClientSession(headers=auth) as s:
            results = await asyncio.gather(
                *(
                    generate(s, router.url, "/v1/chat/completions", max_new_tokens=2)
                    for _ in range(8)
                )
            )
            await asyncio.sleep(0.3)  # a few load polls
            workers = await _workers(s, router.url)
            metrics = await get_text(s, router.url + "/metrics")
            return results, workers, metrics

    results, workers, metrics = run(scenario())
    assert all(r.ok and r.model == "keyed" for r in results), results
    assert list(workers) == [f"{server.url}@0", f"{server.url}@1"]
    assert all(
        w["polled_tokens"] is not None and w["load_poll_failures"] == 0 for w in workers.values()
    )
    assert sum(w["selections"] for w in workers.values()) == 8
    assert f'sglang_router_load_poll_failures_total{{worker="{server.url}"}} 0' in metrics


def test_burst_over_a_real_server_with_a_short_queue_never_opens_the_breaker(procs):
    short = ("--max-running-requests", "1", "--max-queued-requests", "1")
    (server,) = procs.servers(["short"], dp_size=2, extra=short)
    router = procs.router(
        "--worker-urls", server.url, "--dp-aware", "--policy", "round_robin", *TOUCHY, *FAST
    )

    async def scenario():
        async with aiohttp.ClientSession() as s:
            # long enough that the four requests the server admits (one running and one queued a rank) are still
            # there when the rest of the burst and the router's retries arrive: with 24 tokens a full-suite run
            # finished them first and shed nothing; with 400, five runs admitted exactly 4 and shed 8 in ~7 s
            burst = await asyncio.gather(
                *(
                    generate(s, router.url, max_new_tokens=400, stream=i % 2 == 0, timeout=30)
                    for i in range(12)
                )
            )
            after = [await generate(s, router.url, max_new_tokens=2) for _ in range(4)]
            return burst, after, await _workers(s, router.url)

    burst, after, workers = run(scenario())
    statuses = [r.status for r in burst]
    assert set(statuses) <= {200, 503} and 503 in statuses and statuses.count(200) >= 4, statuses
    assert all(r.ok for r in burst if r.status == 200)
    assert all(r.retry_after is not None for r in burst if r.status == 503)
    assert sum(w["sheds"] for w in workers.values()) > 2
    assert all(w["breaker"] == "closed" and w["errors"] == 0 for w in workers.values()), workers
    assert all(r.ok for r in after)  # the burst left no outage behind


def test_with_a_dead_rank_the_live_ranks_keep_their_polled_loads(procs):
    up = procs.upstream(dp_size=2, token_delay=0.05)
    router = procs.router("--worker-urls", up.url, "--dp-aware", "--policy", "power_of_two", *FAST)

    async def scenario():
        async with aiohttp.ClientSession() as s:
            async with s.post(up.url + "/_rank", params={"rank": "1", "alive": "0"}):
                pass
            hold = await _hold(
                s, up.url, 1.0
            )  # some load on rank 0, so its polled tokens are above zero

            async def split() -> bool:
                w = await _workers(s, router.url)
                return (w[f"{up.url}@0"]["polled_tokens"] or 0) > 0 and w[f"{up.url}@1"][
                    "polled_tokens"
                ] is None

            seen = await wait_for(split, timeout=3)
            await hold
            return seen, await _workers(s, router.url)

    seen, workers = run(scenario())
    assert seen  # the whole-server poll is a 503, so each rank was polled alone
    assert (
        workers[f"{up.url}@0"]["load_poll_failures"] > 0
    )  # and the failed whole-server polls were counted
