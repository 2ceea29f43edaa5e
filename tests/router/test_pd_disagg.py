"""Real PD disaggregation: a prefill server and a decode server (dp 2) moving KV, GDN states and the first token
with the Mooncake transfer engine (TCP), behind sglang_lite's router and behind sglang-router 0.3.2.

Greedy tokens must equal transformers ``generate`` on the same checkpoint; prefill must run only on the prefill
server (the decode ranks' prefill token counters stay 0); every PD queue drains. Failures end with clear errors,
bounded in time, and free the decode side's reservation.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time

import aiohttp
import pytest

from sglang_lite.server_args import ServerArgs
from tests.hf_checkpoints import greedy_tokens, make_hf_model, save_checkpoint

from .conftest import Proc, free_port, spawn, wait_until_healthy
from .helpers import get_text, run, wait_for
from .pd_helpers import drained, generate, leave_after_first_event, loads, pd_router

try:
    import mooncake.engine  # noqa: F401
except ImportError as error:  # no silent skip: the PD tests need the transfer engine installed
    raise ImportError(
        "PD tests need the Mooncake transfer engine: pip install mooncake-transfer-engine-non-cuda "
        f"and apt-get install libibverbs1 ({error})"
    ) from error

PROMPTS = [
    [5, 17, 42, 99, 150, 7, 61],
    [9, 140, 2, 77, 120, 12, 3, 3, 8, 31, 64, 100],
    [11] * 30,
    [1, 2, 3],
    list(range(20, 70)),
]
NEW_TOKENS = 8
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
TIMEOUT_S = 5  # --disaggregation-transfer-timeout of the servers here
COMMON = [
    "--context-length",
    "2048",
    "--max-total-tokens",
    "8192",
    "--max-running-requests",
    "8",
    "--cpu-threads-per-rank",
    "1",
    "--skip-tokenizer-init",
    "--disaggregation-transfer-timeout",
    str(TIMEOUT_S),
]


class Checkpoint:
    def __init__(self, path: str) -> None:
        self.model = make_hf_model(
            seed=5, initializer_range=0.1, vocab_size=161
        )  # MoE, GQA, HK 2 / HV 4
        self.path = save_checkpoint(self.model, path)

    def greedy(self, prompt: list[int]) -> list[int]:
        return greedy_tokens(self.model, prompt, NEW_TOKENS)


def server(checkpoint: Checkpoint, mode: str, dp_size: int, *extra: str) -> Proc:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "sglang_lite.launch_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model-path",
        checkpoint.path,
        "--dp-size",
        str(dp_size),
        "--disaggregation-mode",
        mode,
        *COMMON,
        *extra,
    ]
    return spawn(cmd, port)


# --page-size of the prefill and the decode server: the default on both, pages of one token on both, and sides
# that differ (a transfer's runs then follow both sides' page boundaries)
PAGE_SIZES = [(ServerArgs.page_size,) * 2, (1, 1), (ServerArgs.page_size, 1)]


@pytest.fixture(scope="module", params=PAGE_SIZES, ids=lambda p: f"pages{p[0]}-{p[1]}")
def pd(tmp_path_factory, request):
    """A prefill server (dp 1) and a decode server (dp 2) on one checkpoint, shared by the module's tests."""
    checkpoint = Checkpoint(str(tmp_path_factory.mktemp("pd_checkpoint")))
    bootstrap_port = free_port()
    prefill_pages, decode_pages = (str(p) for p in request.param)
    procs = [
        server(
            checkpoint,
            "prefill",
            1,
            "--disaggregation-bootstrap-port",
            str(bootstrap_port),
            "--page-size",
            prefill_pages,
        ),
        server(checkpoint, "decode", 2, "--page-size", decode_pages),
    ]
    try:
        for proc in procs:
            if not wait_until_healthy(proc.url, proc.popen, 180, interval_s=0.25):
                raise RuntimeError(f"a PD server did not start:\n{proc.output()[-3000:]}")
        yield checkpoint, procs[0], procs[1], bootstrap_port
    finally:
        for proc in procs:
            proc.kill()


async def _generate(
    s: aiohttp.ClientSession, url: str, prompt: list[int], **extra
) -> tuple[int, dict]:
    return await generate(s, url, prompt, GREEDY, **extra)


def _through(
    router: Proc, checkpoint: Checkpoint, prefill: Proc, decode: Proc
) -> tuple[list, list, list]:
    async def scenario():
        async with aiohttp.ClientSession() as s:
            before = [
                load["disaggregation"]["num_prefill_tokens"] for load in await loads(s, prefill.url)
            ]
            results = await asyncio.gather(*(_generate(s, router.url, p) for p in PROMPTS))
            assert await wait_for(
                lambda: drained(s, prefill.url, decode.url), timeout=20, interval=0.1
            )
            after = [
                load["disaggregation"]["num_prefill_tokens"] for load in await loads(s, prefill.url)
            ]
            metrics = await get_text(s, decode.url + "/metrics")
            decode_loads = await loads(s, decode.url)
            return results, decode_loads, [a - b for a, b in zip(after, before)], metrics

    return run(scenario())


def _check(
    results: list, decode_loads: list, prefilled: list, metrics: str, checkpoint: Checkpoint
) -> None:
    assert [status for status, _ in results] == [200] * len(PROMPTS), results
    assert [body["output_ids"] for _, body in results] == [checkpoint.greedy(p) for p in PROMPTS]
    assert prefilled == [
        sum(len(p) for p in PROMPTS)
    ]  # every prompt prefilled once, on the prefill server
    decode_pd = [load["disaggregation"] for load in decode_loads]
    assert [pd["num_prefill_tokens"] for pd in decode_pd] == [0, 0]  # never on the decode server
    assert all(pd["mode"] == "decode" for pd in decode_pd)
    received = [
        (load["dp_rank"], pd)
        for load, pd in zip(decode_loads, decode_pd)
        if pd["kv_transfers_total"]
    ]
    assert received and all(pd["kv_transfer_speed_gb_s"] > 0 for _, pd in received)
    for (
        dp_rank,
        pd,
    ) in received:  # every transfer landed in one bucket of each histogram; none is pending
        assert sum(pd["kv_transfer_latency_counts"]) == pd["kv_transfers_total"]
        assert sum(pd["kv_transfer_size_counts"]) == pd["kv_transfers_total"]
        assert pd["kv_transfers_in_flight"] == 0 and pd["kv_transfer_latency_ms"] > 0
        rank = f'dp_rank="{dp_rank}"'
        count = (
            f"sglang_lite_kv_transfer_latency_seconds_count{{{rank}}} {pd['kv_transfers_total']}"
        )
        assert count in metrics
        assert f'sglang_lite_kv_transfer_size_bytes_bucket{{{rank},le="+Inf"}}' in metrics


def test_pd_through_sglang_lite_router_equals_transformers(pd):
    checkpoint, prefill, decode, bootstrap_port = pd
    router = pd_router(
        prefill.url,
        bootstrap_port,
        decode.url,
        *("--log-level", "info", "--dp-aware", "--decode-policy", "power_of_two"),
        *("--p2c-load-metric", "least_requests"),
    )
    try:
        _check(*_through(router, checkpoint, prefill, decode), checkpoint)
    finally:
        router.kill()


def test_pd_through_sglang_router_0_3_2_equals_transformers(pd):
    import sglang_router  # noqa: F401  (not skipped when missing: the test extra pins sglang-router 0.3.2)

    checkpoint, prefill, decode, bootstrap_port = pd
    port = free_port()
    router = spawn(
        [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--pd-disaggregation",
            "--prefill",
            prefill.url,
            str(bootstrap_port),
            "--decode",
            decode.url,
        ],
        port,
    )
    try:
        assert _wait_port(port, 60), router.output()[-2000:]
        _check(*_through(router, checkpoint, prefill, decode), checkpoint)
    finally:
        router.kill()


def _wait_port(port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.2)
    return False


def test_long_prompts_on_a_reused_pool(pd):
    """Prompts of 1100+ tokens, one after another, so that the KV slots of each come from the slots the last one
    freed: thousands of token rows per transfer, which must still arrive whole (coalesced runs, batched writes)."""
    checkpoint, prefill, decode, bootstrap_port = pd
    prompts = [[(7 * i + 13 * j) % 150 + 3 for j in range(1100 + 37 * i)] for i in range(3)]

    async def scenario():
        async with aiohttp.ClientSession() as s:
            results = []
            for i, prompt in enumerate(prompts):
                fields = {
                    "bootstrap_host": "127.0.0.1",
                    "bootstrap_port": bootstrap_port,
                    "bootstrap_room": 900 + i,
                }
                legs = await asyncio.gather(
                    _generate(s, prefill.url, prompt, **fields),
                    _generate(s, decode.url, prompt, **fields),
                )
                results.append(legs)
            return results, await wait_for(
                lambda: drained(s, prefill.url, decode.url), timeout=20, interval=0.1
            )

    results, settled = run(scenario())
    for prompt, (prefill_leg, decode_leg) in zip(prompts, results):
        assert prefill_leg[0] == 200 and decode_leg[0] == 200, (prefill_leg, decode_leg)
        assert decode_leg[1]["output_ids"] == checkpoint.greedy(prompt)
    assert settled


def test_requests_whose_first_token_ends_them(pd):
    """max_new_tokens 1: the first token, sampled on the prefill server, ends the request there as well; its memory
    must outlive the transfer that reads it (the prefill rank once released it mid-write, then died)."""
    checkpoint, prefill, decode, bootstrap_port = pd
    one = {"max_new_tokens": 1, "temperature": 0.0}

    async def scenario():
        async with aiohttp.ClientSession() as s:
            legs = []
            for i, prompt in enumerate(PROMPTS):
                fields = {
                    "bootstrap_host": "127.0.0.1",
                    "bootstrap_port": bootstrap_port,
                    "bootstrap_room": 500 + i,
                    "sampling_params": one,
                }
                legs.append(
                    await asyncio.gather(
                        _generate(s, prefill.url, prompt, **fields),
                        _generate(s, decode.url, prompt, **fields),
                    )
                )
            return legs, await wait_for(
                lambda: drained(s, prefill.url, decode.url), timeout=20, interval=0.1
            )

    legs, settled = run(scenario())
    for prompt, (prefill_leg, decode_leg) in zip(PROMPTS, legs):
        assert prefill_leg[0] == 200 and decode_leg[0] == 200, (prefill_leg, decode_leg)
        assert prefill_leg[1]["output_ids"] == decode_leg[1]["output_ids"]
        assert decode_leg[1]["output_ids"] == checkpoint.greedy(prompt)[:1]
    assert settled


def test_prefill_server_reuses_cached_prefixes(pd):
    """The prefill server's prefix cache: a prompt extending one it has seen prefills only the new tokens, and the
    decode side still gets the whole KV and state (greedy tokens equal transformers)."""
    checkpoint, prefill, decode, bootstrap_port = pd
    base = [(11 * j) % 150 + 2 for j in range(300)]
    follow = base + [5, 6, 7, 8, 9, 10, 11, 12]

    async def scenario():
        async with aiohttp.ClientSession() as s:
            outputs = []
            for i, prompt in enumerate((base, follow)):
                fields = {
                    "bootstrap_host": "127.0.0.1",
                    "bootstrap_port": bootstrap_port,
                    "bootstrap_room": 700 + i,
                }
                legs = await asyncio.gather(
                    _generate(s, prefill.url, prompt, **fields),
                    _generate(s, decode.url, prompt, **fields),
                )
                outputs.append(legs)
            return outputs

    (_, first), (prefill_leg, decode_leg) = run(scenario())
    assert (
        prefill_leg[1]["meta_info"]["cached_tokens"] >= 300
    )  # the first prompt, cached by the prefill server
    assert decode_leg[1]["output_ids"] == checkpoint.greedy(follow)
    assert first[1]["output_ids"] == checkpoint.greedy(base)


# ---- failures ----------------------------------------------------------------------------------------------------
# the refusals and the timeout do not depend on the page sizes: one pair of servers checks them (the timeout takes
# 3 x TIMEOUT_S: the transfer's, then the reservation held twice that)
@pytest.mark.parametrize("pd", PAGE_SIZES[:1], indirect=True, ids=lambda p: f"pages{p[0]}-{p[1]}")
def test_decode_server_refuses_requests_without_bootstrap_and_duplicate_rooms(pd):
    _, prefill, decode, bootstrap_port = pd
    fields = {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": 4242,
    }

    async def scenario():
        async with aiohttp.ClientSession() as s:
            plain = await _generate(s, decode.url, PROMPTS[0])
            first = asyncio.create_task(
                _generate(s, decode.url, PROMPTS[0], **fields)
            )  # no prefill side: waits
            await asyncio.sleep(0.5)
            duplicate = await _generate(s, decode.url, PROMPTS[1], **fields)
            timed_out = await first
            settled = await wait_for(
                lambda: drained(s, decode.url), timeout=2 * TIMEOUT_S + 10, interval=0.2
            )
            return plain, duplicate, timed_out, settled

    plain, duplicate, timed_out, settled = run(scenario())
    assert plain[0] == 400 and "bootstrap_room" in plain[1]["error"]["message"]
    assert (
        duplicate[0] == 400
        and "bootstrap_room 4242 is already in use" in duplicate[1]["error"]["message"]
    )
    # the prefill server kept the destination but never got the request: the decode side gives up, and frees
    assert (
        timed_out[0] == 502  # the PD pair failed it, not this server
        and f"did not finish within {TIMEOUT_S} s" in timed_out[1]["error"]["message"]
    )
    assert settled


def test_unreachable_prefill_server_fails_the_decode_request_at_once(pd):
    _, _, decode, _ = pd
    dead = free_port()  # nothing listens there: as a prefill server that died

    async def scenario():
        async with aiohttp.ClientSession() as s:
            result = await _generate(
                s,
                decode.url,
                PROMPTS[2],
                bootstrap_host="127.0.0.1",
                bootstrap_port=dead,
                bootstrap_room=7,
            )
            # no connection was made: the reservation is freed at once (settled), well before the
            # 2 x TIMEOUT_S that a reservation the prefill side might still write into is held
            return result, await wait_for(
                lambda: drained(s, decode.url), timeout=TIMEOUT_S, interval=0.1
            )

    (status, body), settled = run(scenario())
    assert (
        status == 502
        and f"bootstrap server at 127.0.0.1:{dead} is unreachable" in body["error"]["message"]
    )
    assert settled


def test_client_abort_reaches_both_sides(pd):
    checkpoint, prefill, decode, bootstrap_port = pd
    router = pd_router(prefill.url, bootstrap_port, decode.url)
    try:
        # the client left: the decode request is aborted, the prefill leg too; everything drains. It asks for as
        # many tokens as the context (2048) leaves: 200 ran out before the abort arrived once, on a loaded host.
        ok, aborted = run(
            leave_after_first_event(router.url, PROMPTS[4], 1990, prefill.url, decode.url)
        )
        assert ok and aborted == 1  # ended by the abort, not by running its 1990 tokens out
    finally:
        router.kill()
