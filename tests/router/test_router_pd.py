"""PD disaggregation: a prefill and a decode worker per request, bootstrap fields, decode response returned."""
from __future__ import annotations

import asyncio

import aiohttp

from .helpers import generate, get_json, in_flight, run, wait_for


def _start(procs, *extra: str):
    prefill = procs.upstream(token_delay=0.02, name="prefill")
    decodes = [procs.upstream(dp_size=2, token_delay=0.02, name=f"decode{i}") for i in range(2)]
    router = procs.router("--pd-disaggregation", "--prefill", prefill.url, "9000",
                          *[a for d in decodes for a in ("--decode", d.url)], "--prefill-policy", "random",
                          "--decode-policy", "power_of_two", "--worker-startup-check-interval", "0.1", *extra)
    return prefill, decodes, router


def test_pd_injects_bootstrap_fields_sends_to_both_and_returns_decode(procs):
    prefill, decodes, router = _start(procs, "--dp-aware")

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
    sent = {"text": "pd test", "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "stream": False}
    for body in (p_body, d_body):
        assert {k: body[k] for k in sent} == sent
        assert body["bootstrap_host"] == "127.0.0.1" and body["bootstrap_port"] == 9000
    assert p_body["bootstrap_room"] == d_body["bootstrap_room"] and 0 <= p_body["bootstrap_room"] < 2**63
    assert p_body["routed_dp_rank"] == 0 and d_body["routed_dp_rank"] in (0, 1)
    assert policies == {"prefill": "random", "decode": "power_of_two:tokens"}
    assert len(p_batch["bootstrap_room"]) == 2 and len(set(p_batch["bootstrap_room"])) == 2
    assert p_batch["bootstrap_host"] == ["127.0.0.1"] * 2


def test_pd_in_flight_counted_on_both_sides_and_released(procs):
    prefill, decodes, router = _start(procs)

    async def scenario():
        async with aiohttp.ClientSession() as s:
            streams = [asyncio.create_task(generate(s, router.url, "/v1/chat/completions", stream=True,
                                                    max_new_tokens=15)) for _ in range(6)]
            await asyncio.sleep(0.15)
            during = await in_flight(s, router.url)
            results = await asyncio.gather(*streams)
            released = await wait_for(lambda: _zero(s, router.url), timeout=3)
        return during, results, released

    during, results, released = run(scenario())
    assert all(r.ok and r.chunks == 16 and r.upstream.startswith("decode") for r in results)
    assert during[prefill.url] == 6 and sum(v for k, v in during.items() if k != prefill.url) == 6, during
    assert released


async def _zero(s: aiohttp.ClientSession, url: str) -> bool:
    return set((await in_flight(s, url)).values()) == {0}
