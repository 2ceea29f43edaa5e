"""PD disaggregation: a prefill and a decode worker per request, bootstrap fields, decode response returned.

A real server in the default disaggregation mode (null) accepts the bootstrap fields and ignores them, so
in-flight accounting and the round trip run against real servers (tests/router/test_pd_disagg.py runs real PD).
It does not echo the fields, so the test of exactly what the router injects runs against the stand-in, which
records the bodies it received.
"""

from __future__ import annotations

import asyncio

import aiohttp

from .helpers import (
    chat_streams,
    delta,
    finish_reason,
    generate,
    get_json,
    in_flight,
    paused,
    routed,
    run,
    scheduler_pids,
    wait_for,
)


def test_pd_injects_bootstrap_fields_sends_to_both_and_returns_decode(procs):
    prefill = procs.upstream(name="prefill")
    decodes = [procs.upstream(dp_size=2, name=f"decode{i}") for i in range(2)]
    router = procs.router(
        "--pd-disaggregation",
        "--prefill",
        prefill.url,
        "9000",
        *[a for d in decodes for a in ("--decode", d.url)],
        "--prefill-policy",
        "random",
        "--decode-policy",
        "power_of_two",
        "--worker-startup-check-interval",
        "0.1",
        "--dp-aware",
    )

    async def scenario():
        async with aiohttp.ClientSession() as s:
            r = await generate(s, router.url, max_new_tokens=3, text="pd test")
            p_stats = await get_json(s, prefill.url + "/_stats")
            d_stats = [await get_json(s, d.url + "/_stats") for d in decodes]
            policies = (await get_json(s, router.url + "/workers"))["policies"]
            batch = {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 1}}
            async with s.post(router.url + "/generate", json=batch) as resp:
                assert resp.status == 200
            p_batch = (await get_json(s, prefill.url + "/_stats"))["bodies"][-1]
        return r, p_stats, d_stats, policies, p_batch

    r, p_stats, d_stats, policies, p_batch = run(scenario())
    assert r.ok and r.upstream in ("decode0", "decode1")
    [p_body] = p_stats["bodies"]
    [d_body] = [b for st in d_stats for b in st["bodies"]]
    sent = {
        "text": "pd test",
        "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
        "stream": False,
    }
    for body in (p_body, d_body):
        assert {k: body[k] for k in sent} == sent
        assert body["bootstrap_host"] == "127.0.0.1" and body["bootstrap_port"] == 9000
    assert (
        p_body["bootstrap_room"] == d_body["bootstrap_room"]
        and 0 <= p_body["bootstrap_room"] < 2**63
    )
    assert p_body["routed_dp_rank"] == 0 and d_body["routed_dp_rank"] in (0, 1)
    assert policies == {"prefill": "random", "decode": "power_of_two:tokens"}
    assert len(p_batch["bootstrap_room"]) == 2 and len(set(p_batch["bootstrap_room"])) == 2
    assert p_batch["bootstrap_host"] == ["127.0.0.1"] * 2


def test_pd_with_real_servers_counts_both_sides_and_returns_decode(procs, dp_pair):
    prefill, decode = dp_pair  # s0 prefills, s1 decodes (each its own dp-size-2 server)
    router = procs.router(
        "--pd-disaggregation",
        "--prefill",
        prefill.url,
        "9000",
        "--decode",
        decode.url,
        "--prefill-policy",
        "random",
        "--decode-policy",
        "power_of_two",
        "--worker-startup-check-interval",
        "0.1",
    )

    async def scenario():
        async with aiohttp.ClientSession() as s:
            before = [await routed(s, u.url) for u in dp_pair]
            # keep the snapshot that had every leg in flight: the servers' schedulers are stopped while the streams
            # are sent, so both legs of all six are in flight together however fast (or loaded) the host is
            pids = [pid for u in dp_pair for pid in await scheduler_pids(s, u.url)]
            seen: list[dict[str, int]] = []
            with paused(pids):
                streams = chat_streams(s, router.url, 6)
                counted = await wait_for(lambda: _total(s, router.url, 12, seen), timeout=20)
            results = await asyncio.gather(*streams)
            assert counted, (seen[-3:], results[:2])
            during = seen[-1]
            released = await wait_for(lambda: _zero(s, router.url), timeout=5)
            batch = {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 1}}
            async with s.post(router.url + "/generate", json=batch) as resp:
                batched = (resp.status, await resp.json())
            # the decode leg answers the client; the prefill leg (and its server's count) may end a moment later
            released = released and await wait_for(lambda: _zero(s, router.url), timeout=5)
            after = [await routed(s, u.url) for u in dp_pair]
        return (
            during,
            results,
            released,
            batched,
            [sum(delta(a, b).values()) for a, b in zip(after, before)],
        )

    during, results, released, batched, per_server = run(scenario())
    assert during == {prefill.url: 6, decode.url: 6}, during
    assert all(r.ok and finish_reason(r) == "length" and r.model == "s1" for r in results), results[
        :2
    ]
    assert released
    assert batched[0] == 200 and [len(x["output_ids"]) for x in batched[1]] == [
        1,
        1,
    ]  # lists of bootstrap fields
    assert per_server == [
        8,
        8,
    ]  # both legs of every request (6 streams, 2 batched prompts) reached their server


async def _total(s: aiohttp.ClientSession, url: str, n: int, seen: list[dict[str, int]]) -> bool:
    seen.append(await in_flight(s, url))
    return sum(seen[-1].values()) == n


async def _zero(s: aiohttp.ClientSession, url: str) -> bool:
    return set((await in_flight(s, url)).values()) == {0}


def test_a_failed_prefill_leg_fails_its_decode_request_by_room(procs):
    """The prefill worker answers 503 (its rank is dead): the router tells the decode worker at once, by the
    request's room, that the prefill side will write nothing for it (settled), instead of leaving the decode
    request to wait for its transfer timeout."""
    prefill = procs.upstream(name="prefill")
    decode = procs.upstream(name="decode", token_delay=0.05)
    router = procs.router(
        *("--pd-disaggregation", "--prefill", prefill.url, "9000", "--decode", decode.url),
        *("--worker-startup-check-interval", "0.1"),
    )

    async def scenario():
        async with aiohttp.ClientSession() as s:
            async with s.post(prefill.url + "/_rank?rank=0&alive=0") as resp:
                assert resp.status == 200
            r = await generate(s, router.url, max_new_tokens=20, text="pd abort")

            async def aborted() -> bool:
                return bool((await get_json(s, decode.url + "/_stats"))["aborts"])

            assert await wait_for(aborted, timeout=10)
            return r, await get_json(s, decode.url + "/_stats")

    r, stats = run(scenario())
    assert r.ok  # the stand-in decode worker ignores the abort and runs its tokens out
    [body] = stats["bodies"]
    [abort] = stats["aborts"]
    assert abort["bootstrap_room"] == [body["bootstrap_room"]]
    assert abort["status_code"] == 502 and abort["settled"] is True
    assert "prefill server" in abort["error"] and "DP rank 0 is not alive" in abort["error"]
