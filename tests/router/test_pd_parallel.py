"""The upstream p2c study's deployment on the CPU: a prefill server with tensor parallelism and DP attention (TP 2,
2 DP-attention ranks) and a decode server with 4 DP-attention ranks that meet in the MoE every layer (TP 4), the
built-in model, behind sglang_lite's router (``--pd-disaggregation --dp-aware``, least_requests) and behind
sglang-router 0.3.2. Greedy tokens equal transformers', every decode DP rank serves, log-probabilities and the
prefill side's cache hits travel with the transfer, both servers answer /health_generate, and every queue drains.
"""

from __future__ import annotations

import asyncio
import sys

import aiohttp
import pytest
from transformers import Qwen3_5MoeForCausalLM

from sglang_lite import assets

from .conftest import free_port, spawn
from .helpers import get_json, run, wait_for
from .pd_helpers import Reference, drained, generate, loads, pd_router, pd_server
from .test_pd_disagg import _wait_port

NEW_TOKENS = 6
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[(17 * i + 5 * j) % 4000 + 10 for j in range(8 + 9 * i)] for i in range(8)]
COMMON = [
    "--context-length",
    "2048",
    "--max-total-tokens",
    "8192",
    "--max-running-requests",
    "16",  # the server's total: 8 per prefill DP rank, 4 per decode DP rank
    "--cpu-threads-per-rank",
    "1",
    "--disaggregation-transfer-timeout",
    "20",
    "--log-level",
    "warning",
]


@pytest.fixture(scope="module")
def cluster():
    """Prefill TP 2 with DP attention 2, decode TP 4 with DP attention 4, one bootstrap port both know (so a
    request whose bootstrap_port is null finds it)."""
    bootstrap = str(free_port())
    shared = [*COMMON, "--enable-dp-attention", "--disaggregation-bootstrap-port", bootstrap]
    procs = [
        pd_server(None, "prefill", "--tp-size", "2", "--dp-size", "2", *shared),
        pd_server(
            None, "decode", "--tensor-parallel-size", "4", "--data-parallel-size", "4", *shared
        ),
    ]
    try:
        for proc in procs:
            proc.wait_healthy(300)
        model = Qwen3_5MoeForCausalLM.from_pretrained(assets.model_dir(None)).float().eval()
        yield Reference(model), procs[0], procs[1], int(bootstrap)
    finally:
        for proc in procs:
            proc.kill()


def pd(load: dict) -> dict:
    return load["disaggregation"]


def _router(prefill, decode, bootstrap: int | None, *flags: str):
    return pd_router(prefill.url, bootstrap, decode.url, *flags)


def test_greedy_tokens_through_the_dp_aware_router_and_every_decode_rank_serves(cluster):
    reference, prefill, decode, bootstrap = cluster
    router = _router(
        prefill,
        decode,
        bootstrap,
        *("--dp-aware", "--decode-policy", "power_of_two", "--p2c-load-metric", "least_requests"),
    )

    async def scenario():
        async with aiohttp.ClientSession() as s:
            before = [pd(load)["kv_transfers_total"] for load in await loads(s, decode.url)]
            results = await asyncio.gather(*(generate(s, router.url, p, GREEDY) for p in PROMPTS))
            ok = await wait_for(lambda: drained(s, prefill.url, decode.url), timeout=60)
            after = await loads(s, decode.url)
            return (
                results,
                ok,
                [pd(a)["kv_transfers_total"] - b for a, b in zip(after, before)],
                after,
            )

    try:
        results, ok, received, decode_loads = run(scenario())
    finally:
        router.kill()
    assert [status for status, _ in results] == [200] * len(PROMPTS), results
    assert [body["output_ids"] for _, body in results] == [
        reference.greedy(p, NEW_TOKENS) for p in PROMPTS
    ]
    assert ok  # every queue of both servers drained
    assert len(received) == 4 and all(n > 0 for n in received), received
    assert [pd(load)["num_prefill_tokens"] for load in decode_loads] == [0, 0, 0, 0]
    # --max-running-requests 16 is the decode server's total over its 4 DP-attention ranks
    assert [load["max_running_requests"] for load in decode_loads] == [4, 4, 4, 4]


def test_log_probabilities_and_cache_hits_travel_with_the_transfer(cluster):
    """The first token's and the prompt's log-probabilities are computed on the prefill server and reported by the
    decode server, equal to transformers'; a prompt extending a cached one reports the prefill side's hit."""
    reference, prefill, decode, bootstrap = cluster
    prompt = PROMPTS[5]
    asked = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3}

    async def legs(s, prompt, room, **extra):
        fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": None, "bootstrap_room": room}
        prefill_leg = generate(
            s, prefill.url, prompt, GREEDY, **fields, **extra, data_parallel_rank=1
        )
        decode_leg = generate(
            s, decode.url, prompt, GREEDY, **fields, **extra, data_parallel_rank=2
        )
        return await asyncio.gather(prefill_leg, decode_leg)

    base = [(7 * j) % 3000 + 20 for j in range(300)]

    async def scenario():
        async with aiohttp.ClientSession() as s:
            logprob_legs = await legs(s, prompt, 101, **asked)
            await legs(s, base, 102)
            cached_legs = await legs(s, base + [11, 12, 13], 103)
            return (
                logprob_legs,
                cached_legs,
                await wait_for(lambda: drained(s, prefill.url, decode.url), timeout=60),
            )

    (prefill_leg, decode_leg), (_, cached_leg), ok = run(scenario())
    assert prefill_leg[0] == 200 and decode_leg[0] == 200, (prefill_leg, decode_leg)
    assert (
        prefill_leg[1]["output_ids"] == decode_leg[1]["output_ids"][:1]
    )  # the prefill leg ends at one
    meta = decode_leg[1]["meta_info"]
    tokens = prompt + decode_leg[1]["output_ids"]
    want = reference.logprobs(tokens)
    inputs = meta["input_token_logprobs"]
    assert inputs[0] == [None, prompt[0], None] and len(inputs) == len(prompt)
    for i, (value, token, _) in enumerate(inputs[1:], start=1):
        assert token == prompt[i] and abs(value - float(want[i - 1, token])) < 2e-3
    outputs = meta["output_token_logprobs"]
    assert len(outputs) == NEW_TOKENS
    for i, (value, token, _) in enumerate(outputs):
        assert abs(value - float(want[len(prompt) - 1 + i, token])) < 2e-3
    first_top = [t for _, t, _ in meta["output_top_logprobs"][0]]
    assert first_top == want[len(prompt) - 1].topk(3).indices.tolist()
    assert cached_leg[0] == 200 and cached_leg[1]["meta_info"]["cached_tokens"] >= 256
    assert ok


def test_openai_echo_with_logprobs_through_pd(cluster):
    _, prefill, decode, bootstrap = cluster
    router = _router(prefill, decode, None)  # no bootstrap port: the servers' own
    body = {
        "model": "tiny_qwen3_5_moe",
        "prompt": "def reverse_list(items):",
        "max_tokens": 4,
        "temperature": 0,
        "echo": True,
        "logprobs": 2,
    }

    async def scenario():
        async with aiohttp.ClientSession() as s:
            async with s.post(router.url + "/v1/completions", json=body) as response:
                reply = (response.status, await response.json(content_type=None))
            return reply, await wait_for(lambda: drained(s, prefill.url, decode.url), timeout=60)

    try:
        (status, reply), ok = run(scenario())
    finally:
        router.kill()
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["text"].startswith(body["prompt"])
    logprobs = choice["logprobs"]
    prompt_tokens = reply["usage"]["prompt_tokens"]
    assert len(logprobs["token_logprobs"]) == prompt_tokens + 4
    assert logprobs["token_logprobs"][0] is None
    assert all(isinstance(v, float) for v in logprobs["token_logprobs"][1:])
    # the two most likely tokens and the chosen one, keyed by their text (equal texts share a key)
    assert all(1 <= len(top) <= 3 for top in logprobs["top_logprobs"][1:]), logprobs
    assert ok


def test_health_generate_on_both_pd_servers(cluster):
    _, prefill, decode, _ = cluster

    async def scenario():
        async with aiohttp.ClientSession() as s:
            return [
                await get_json(s, server.url + "/health_generate") for server in (prefill, decode)
            ]

    assert [reply["healthy"] for reply in run(scenario())] == [True, True]


def test_sglang_router_0_3_2_drives_the_same_pair(cluster):
    import sglang_router  # noqa: F401  (not skipped when missing: the test extra pins sglang-router 0.3.2)

    reference, prefill, decode, _ = cluster
    port = free_port()
    router = spawn(
        [
            *(sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"),
            *("--port", str(port), "--pd-disaggregation", "--prefill", prefill.url),
            *("--decode", decode.url),
        ],
        port,
    )

    async def scenario():
        async with aiohttp.ClientSession() as s:
            results = await asyncio.gather(
                *(generate(s, f"http://127.0.0.1:{port}", p, GREEDY) for p in PROMPTS[:4])
            )
            return results, await wait_for(lambda: drained(s, prefill.url, decode.url), timeout=60)

    try:
        assert _wait_port(port, 60), router.output()[-2000:]
        results, ok = run(scenario())
    finally:
        router.kill()
    assert [body.get("output_ids") for _, body in results] == [
        reference.greedy(p, NEW_TOKENS) for p in PROMPTS[:4]
    ], results
    assert ok
