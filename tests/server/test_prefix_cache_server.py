"""The prefix cache through the HTTP server: a follow-up that extends a prompt reports its cached tokens (native
meta_info, OpenAI usage, /v1/loads, /metrics), gives the same tokens as a server with --disable-radix-cache, and
/flush_cache empties it."""

from __future__ import annotations

import contextlib
import random

import httpx

from tests.server.conftest import ServerProcess, get_loads, start_server, wait_idle

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def generate(server: ServerProcess, ids: list[int]) -> dict:
    body = {"input_ids": ids, "sampling_params": GREEDY, "routed_dp_rank": 0}
    response = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_follow_ups_hit_the_cache_and_match_a_server_without_it(
    server_dp1: ServerProcess, tmp_path_factory
):
    rng = random.Random(11)
    base = [rng.randrange(10, 4000) for _ in range(300)]
    follow = base + [rng.randrange(10, 4000) for _ in range(20)]
    generate(server_dp1, base)
    hit = generate(server_dp1, follow)
    assert hit["meta_info"]["cached_tokens"] >= 300
    chat = httpx.post(
        f"{server_dp1.url}/v1/completions",
        timeout=60,
        json={"prompt": follow, "max_tokens": 2, "temperature": 0},
    )
    assert chat.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 300
    wait_idle(server_dp1)
    (load,) = get_loads(server_dp1)["loads"]
    assert (
        load["cached_tokens"] >= 320 and load["cache_hit_rate"] > 0 and load["num_used_tokens"] == 0
    )
    metrics = httpx.get(f"{server_dp1.url}/metrics", timeout=10).text
    assert 'sglang_lite_cached_prompt_tokens_total{dp_rank="0"}' in metrics

    flags = ["--dp-size", "1", "--disable-radix-cache"]
    with contextlib.contextmanager(start_server)(tmp_path_factory, "no_radix", flags) as plain:
        generate(plain, base)
        miss = generate(plain, follow)
    assert miss["meta_info"]["cached_tokens"] == 0
    assert miss["output_ids"] == hit["output_ids"]  # same dummy weights (same seed), same tokens

    flushed = httpx.post(f"{server_dp1.url}/flush_cache", timeout=10).json()
    assert flushed["freed_tokens"] >= 320
    assert get_loads(server_dp1)["loads"][0]["cached_tokens"] == 0


def test_usage_reports_cached_tokens_only_with_enable_cache_report(server_dp2: ServerProcess):
    body = {"prompt": [11, 12, 13, 14], "max_tokens": 1, "temperature": 0}
    for _ in range(2):  # the second hits the cache, but this server reports no cached tokens
        done = httpx.post(f"{server_dp2.url}/v1/completions", timeout=60, json=body)
        assert done.status_code == 200, done.text
        assert "prompt_tokens_details" not in done.json()["usage"]
