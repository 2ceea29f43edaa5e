"""Chaos through the router (issue 15): a real dp-size 2 server behind `--dp-aware`, one rank killed (kill -9) under
streaming load and a steady trickle of short requests.

The killed rank's streams end with an error event, the other rank's finish, new requests keep succeeding (the
router skips the dead rank or retries its 503 on the live one), the supervisor restarts the rank, the router routes
to it again, and nothing stays counted in flight, in the router or in the server. Every wait is bounded, and the
procs fixture kills the server and the router whatever happens.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp

from .helpers import (
    Result,
    delta,
    generate,
    get_json,
    in_flight,
    routed,
    run,
    server_idle,
    wait_for,
)

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
RETRIES = ["--retry-max-retries", "3", "--retry-initial-backoff-ms", "5"]
VICTIM = 1
STREAMS = 8  # round robin: four on each rank
STREAM_TOKENS = (
    900  # long enough to be mid-stream at the kill (context 1024), short enough for the survivors
)
GRACE_S = (
    1.0  # requests sent within this long after the kill may fail; every later one must succeed
)
RESTART_TIMEOUT_S = (
    30.0  # 1 s backoff, then a rank's start-up (imports torch, builds the model) on 2 busy cores
)


async def stream(
    s: aiohttp.ClientSession, router_url: str, i: int, started: asyncio.Event, out: dict
) -> Result:
    """One long streaming /generate through the router; `out["rank"]` is the rank its first event names."""
    body = {
        "text": f"chaos stream {i}",
        "stream": True,
        "sampling_params": {"max_new_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True},
    }
    result = Result(0)
    start = time.perf_counter()
    try:
        async with s.post(
            router_url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=45)
        ) as resp:
            result.status = resp.status
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                result.body = event
                result.chunks += 1
                if "error" in event:
                    result.error = event["error"]["message"]
                elif "rank" not in out:
                    out["rank"] = event["meta_info"]["dp_rank"]
                    started.set()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        result.error = repr(exc)
    started.set()  # a stream that failed before its first token must not stall the kill
    result.elapsed = time.perf_counter() - start
    return result


async def trickle(
    s: aiohttp.ClientSession, router_url: str, stop: asyncio.Event, sent: list[tuple[float, Result]]
) -> None:
    """Short requests one after another (0.1 s apart) until `stop`; each with the time it was sent."""
    while not stop.is_set():
        at = time.monotonic()
        sent.append((at, await generate(s, router_url, max_new_tokens=2, timeout=15)))
        await asyncio.sleep(0.1)


def test_a_killed_rank_behind_the_router_fails_only_its_streams_and_is_used_again(procs):
    (server,) = procs.servers(["chaos"], dp_size=2, extra=("--rank-hang-timeout-s", "5"))
    router = procs.router(
        "--worker-urls", server.url, "--dp-aware", "--policy", "round_robin", *RETRIES, *FAST
    )

    async def scenario():
        async with aiohttp.ClientSession() as s:
            old_pids = (await get_json(s, server.url + "/server_info"))["scheduler_pids"]
            stop, sent = asyncio.Event(), []
            ticker = asyncio.create_task(trickle(s, router.url, stop, sent))
            starts = [asyncio.Event() for _ in range(STREAMS)]
            ranks = [{} for _ in range(STREAMS)]
            streams = [
                asyncio.create_task(stream(s, router.url, i, starts[i], ranks[i]))
                for i in range(STREAMS)
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in starts)), 20)
            os.kill(old_pids[VICTIM], signal.SIGKILL)
            killed_at = time.monotonic()
            seen_down = []  # the router's view of the victim rank from the kill until the server restarted it

            async def watch() -> None:
                while True:
                    seen_down.append(
                        not (await get_json(s, router.url + "/workers"))["workers"][VICTIM][
                            "rank_up"
                        ]
                    )
                    await asyncio.sleep(0.1)

            watcher = asyncio.create_task(watch())  # the survivors' streams may outlast the restart
            results = await asyncio.wait_for(asyncio.gather(*streams), 45)
            streams_done = time.monotonic() - killed_at

            async def restarted() -> bool:
                async with s.get(
                    server.url + "/health", timeout=aiohttp.ClientTimeout(total=5)
                ) as resp:
                    if resp.status != 200:
                        return False
                pids = (await get_json(s, server.url + "/server_info"))["scheduler_pids"]
                return pids[VICTIM] != old_pids[VICTIM]

            back = await wait_for(restarted, timeout=RESTART_TIMEOUT_S, interval=0.2)
            back_after = time.monotonic() - killed_at
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            new_pids = (await get_json(s, server.url + "/server_info"))["scheduler_pids"]

            async def routed_again() -> bool:
                return (await get_json(s, router.url + "/workers"))["workers"][VICTIM]["rank_up"]

            rank_back = await wait_for(routed_again, timeout=5)
            stop.set()
            await asyncio.wait_for(ticker, 20)
            before = await routed(s, server.url)
            again = [await generate(s, router.url, max_new_tokens=2, timeout=15) for _ in range(6)]
            spread = delta(await routed(s, server.url), before)

            async def router_idle() -> bool:
                return not any((await in_flight(s, router.url)).values())

            async def idle() -> bool:
                return await router_idle() and await server_idle(s, server.url)

            settled = await wait_for(idle, timeout=10, interval=0.1)
            return dict(
                old_pids=old_pids,
                new_pids=new_pids,
                killed_at=killed_at,
                results=results,
                ranks=ranks,
                sent=sent,
                back=back,
                seen_down=any(seen_down),
                rank_back=rank_back,
                again=again,
                spread=spread,
                settled=settled,
                streams_done=streams_done,
                back_after=back_after,
                workers=(await get_json(s, router.url + "/workers"))["workers"],
                flights=await in_flight(s, router.url),
            )

    r = run(scenario())
    print(
        f"streams ended {r['streams_done']:.1f} s and the rank was back {r['back_after']:.1f} s after the kill; "
        f"{len(r['sent'])} trickle requests"
    )
    on_victim = [res for res, rank in zip(r["results"], r["ranks"]) if rank.get("rank") == VICTIM]
    on_other = [
        res for res, rank in zip(r["results"], r["ranks"]) if rank.get("rank") == 1 - VICTIM
    ]
    assert len(on_victim) == len(on_other) == STREAMS // 2, r[
        "ranks"
    ]  # round robin put half on each rank
    for (
        res
    ) in on_victim:  # some tokens, then the server's 503 error event naming the dead rank; no hang
        assert res.status == 200 and res.chunks >= 2, res
        assert res.error is not None and f"DP rank {VICTIM} died" in res.error, res
        assert res.body["error"]["code"] == 503, res
    for res in on_other:  # untouched: every token, finished by length
        assert res.ok, res
        assert (
            len(res.body["output_ids"]) == STREAM_TOKENS
            and res.body["meta_info"]["finish_reason"]["type"] == "length"
        ), res.body["meta_info"]

    before_kill = [res for at, res in r["sent"] if at < r["killed_at"]]
    in_the_instant = [
        res for at, res in r["sent"] if r["killed_at"] <= at < r["killed_at"] + GRACE_S
    ]
    after = [res for at, res in r["sent"] if at >= r["killed_at"] + GRACE_S]
    outage = [
        res
        for at, res in r["sent"]
        if r["killed_at"] + GRACE_S <= at < r["killed_at"] + r["back_after"]
    ]
    print(
        f"trickle: {len(before_kill)} before the kill, {len(in_the_instant)} in the instant "
        f"({sum(not res.ok for res in in_the_instant)} failed), {len(outage)} while the rank was away, "
        f"{len(after)} after the grace"
    )
    assert all(res.ok for res in before_kill), before_kill
    assert sum(not res.ok for res in in_the_instant) <= 2, in_the_instant
    assert after and all(res.ok for res in after), [res for res in after if not res.ok]
    served_by = {res.body["meta_info"]["dp_rank"] for res in after}
    assert 1 - VICTIM in served_by, (
        served_by
    )  # the live rank carried the load while the victim was away
    assert len(outage) >= 3, "the trickle sent too little while the rank was away to show anything"
    assert r["seen_down"], "the router never marked the dead rank down"

    assert r["back"], "the supervisor did not restart the killed rank in time"
    assert (
        r["new_pids"][VICTIM] != r["old_pids"][VICTIM]
        and r["new_pids"][1 - VICTIM] == r["old_pids"][1 - VICTIM]
    )
    assert r["rank_back"], r["workers"]
    assert all(res.ok for res in r["again"]), r["again"]
    assert {res.body["meta_info"]["dp_rank"] for res in r["again"]} == {0, 1}, r["again"]
    assert set(r["spread"]) == {0, 1}, r["spread"]  # the server's own per-rank counters agree
    assert r["settled"], (r["flights"], r["workers"])
    assert not any(r["flights"].values())
    assert all(w["breaker"] == "closed" for w in r["workers"]), r["workers"]
