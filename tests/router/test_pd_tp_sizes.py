"""PD between servers of different tensor-parallel sizes (prefill TP 1 -> decode TP 2, TP 2 -> TP 1, TP 2 -> TP 2):
each prefill rank writes its heads into the decode ranks that hold them, and greedy tokens equal transformers'.
And PD's failures with TP 2 on both sides, each bounded in time and leaving every queue and pool empty: a decode
request whose prefill never comes, an unreachable prefill server, a transfer the transfer engine refuses, and a
client that leaves."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from transformers import Qwen3_5MoeForCausalLM

from sglang_lite import assets

from .conftest import free_port
from .helpers import run, wait_for
from .pd_helpers import Reference, drained, generate, leave_after_first_event, pd_router, pd_server

NEW_TOKENS = 6
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
TIMEOUT_S = 5  # --disaggregation-transfer-timeout
COMMON = [
    "--context-length",
    "2048",
    "--max-total-tokens",
    "8192",
    "--max-running-requests",
    "8",
    "--cpu-threads-per-rank",
    "1",
    "--disaggregation-transfer-timeout",
    str(TIMEOUT_S),
    "--skip-tokenizer-init",
    "--log-level",
    "warning",
]
PROMPTS = [[5, 17, 42, 99, 150, 7, 61], [(13 * j) % 3000 + 9 for j in range(700)], [11] * 30]


@pytest.fixture(scope="module")
def servers():
    """Prefill and decode servers at TP 1 and TP 2 (started together), by name."""
    ports = {"P1": free_port(), "P2": free_port()}
    procs = {
        "P1": pd_server(
            None, "prefill", *COMMON, "--disaggregation-bootstrap-port", str(ports["P1"])
        ),
        "P2": pd_server(
            None,
            "prefill",
            "--tp",
            "2",
            *COMMON,
            "--disaggregation-bootstrap-port",
            str(ports["P2"]),
        ),
        "D1": pd_server(None, "decode", *COMMON),
        "D2": pd_server(None, "decode", "--tp-size", "2", *COMMON),
    }
    try:
        for proc in procs.values():
            proc.wait_healthy(300)
        model = Qwen3_5MoeForCausalLM.from_pretrained(assets.model_dir(None)).float().eval()
        yield Reference(model), procs, ports
    finally:
        for proc in procs.values():
            proc.kill()


def _fields(port: int, room: int) -> dict:
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}


@pytest.mark.parametrize("prefill,decode", [("P1", "D2"), ("P2", "D1"), ("P2", "D2")])
def test_tp_sizes_of_the_two_sides_give_the_same_tokens(servers, prefill: str, decode: str) -> None:
    reference, procs, ports = servers
    p, d = procs[prefill], procs[decode]
    base = 1000 * int(prefill[1]) + 100 * int(decode[1])

    async def scenario():
        async with aiohttp.ClientSession() as s:
            legs = [
                asyncio.gather(
                    generate(s, p.url, prompt, GREEDY, **_fields(ports[prefill], base + i)),
                    generate(s, d.url, prompt, GREEDY, **_fields(ports[prefill], base + i)),
                )
                for i, prompt in enumerate(PROMPTS)
            ]
            return await asyncio.gather(*legs), await wait_for(
                lambda: drained(s, p.url, d.url), timeout=30
            )

    results, ok = run(scenario())
    for prompt, (prefill_leg, decode_leg) in zip(PROMPTS, results):
        assert prefill_leg[0] == 200 and decode_leg[0] == 200, (prefill_leg, decode_leg)
        assert decode_leg[1]["output_ids"] == reference.greedy(prompt, NEW_TOKENS)
        assert prefill_leg[1]["output_ids"] == decode_leg[1]["output_ids"][:1]
    assert ok


async def _corrupting_relay(real_port: int) -> tuple[web.AppRunner, int]:
    """A bootstrap server in front of the real one that aims every KV page outside the decode ranks' memory: the
    transfer engine refuses the prefill side's writes (the metadata rows stay writable)."""

    async def target(request: web.Request) -> web.Response:
        body = await request.json()
        body["target"]["kv_pages"] = [10**9 + page for page in body["target"]["kv_pages"]]
        async with aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{real_port}/pd/target"
            async with s.post(url, json=body) as response:
                return web.json_response(await response.json(), status=response.status)

    app = web.Application()
    app.router.add_post("/pd/target", target)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


def test_a_refused_transfer_fails_both_sides_and_frees_everything(servers) -> None:
    _, procs, ports = servers
    p, d = procs["P2"], procs["D2"]

    async def scenario():
        runner, relay = await _corrupting_relay(ports["P2"])
        try:
            async with aiohttp.ClientSession() as s:
                legs = await asyncio.gather(
                    generate(s, p.url, PROMPTS[0], GREEDY, **_fields(ports["P2"], 5001)),
                    generate(s, d.url, PROMPTS[0], GREEDY, **_fields(relay, 5001)),
                )
                return legs, await wait_for(lambda: drained(s, p.url, d.url), timeout=30)
        finally:
            await runner.cleanup()

    (prefill_leg, decode_leg), ok = run(scenario())
    assert prefill_leg[0] == 502 and "KV transfer to the decode server failed" in str(
        prefill_leg[1]
    )
    assert decode_leg[0] == 502 and "the prefill server's KV transfer failed" in str(decode_leg[1])
    assert ok


def test_a_decode_request_whose_prefill_never_comes_times_out_and_frees(servers) -> None:
    _, procs, ports = servers
    d = procs["D2"]

    async def scenario():
        async with aiohttp.ClientSession() as s:
            leg = await generate(s, d.url, PROMPTS[2], GREEDY, **_fields(ports["P2"], 5002))
            return leg, await wait_for(
                lambda: drained(s, d.url, procs["P2"].url), timeout=TIMEOUT_S + 20
            )

    (status, body), ok = run(scenario())
    assert status == 502 and f"did not finish within {TIMEOUT_S} s" in body["error"]["message"]
    assert ok


def test_an_unreachable_prefill_server_fails_the_decode_request_at_once(servers) -> None:
    _, procs, _ = servers
    d = procs["D2"]
    dead = free_port()

    async def scenario():
        async with aiohttp.ClientSession() as s:
            leg = await generate(s, d.url, PROMPTS[0], GREEDY, **_fields(dead, 5003))
            # freed at once (no connection, so no write can come), not held 2 x TIMEOUT_S
            return leg, await wait_for(lambda: drained(s, d.url), timeout=TIMEOUT_S)

    (status, body), ok = run(scenario())
    assert status == 502 and f"127.0.0.1:{dead} is unreachable" in body["error"]["message"]
    assert ok


def test_a_client_abort_reaches_both_tp_sides(servers) -> None:
    _, procs, ports = servers
    p, d = procs["P2"], procs["D2"]
    router = pd_router(p.url, ports["P2"], d.url)
    try:
        # as many tokens as the context (2048) leaves after the 700-token prompt, so the abort arrives first
        ok, aborted = run(leave_after_first_event(router.url, PROMPTS[1], 1340, p.url, d.url))
    finally:
        router.kill()
    assert ok and aborted == 1  # ended by the abort, not by running its 1340 tokens out
