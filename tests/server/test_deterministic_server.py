"""Deterministic inference across DP ranks (issue 52): a server of two DP ranks with
``--enable-deterministic-inference`` gives each prompt the same token ids and logprobs on either rank, alone or
beside other requests."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.engine.conftest import random_prompts
from tests.server.conftest import ServerProcess, start_server

PARAMS = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
SAMPLED = {"temperature": 0.8, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 5}


@pytest.fixture(scope="module")
def deterministic_dp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    flags = ["--dp-size", "2", "--enable-deterministic-inference", "--cpu-threads-per-rank", "1"]
    yield from start_server(tmp_path_factory, "deterministic_dp2", flags)


def _generate(server: ServerProcess, prompt: list[int], rank: int, params: dict) -> dict:
    body = {
        "input_ids": prompt,
        "data_parallel_rank": rank,
        "sampling_params": params,
        "return_logprob": True,
    }
    response = httpx.post(f"{server.url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _send(server: ServerProcess, i: int, prompt: list[int], params: dict, results: dict) -> None:
    results[i] = _generate(server, prompt, 1, params)


def _completion(result: dict) -> tuple[list[int], list[float]]:
    assert "output_ids" in result, result
    return result["output_ids"], [
        entry[0] for entry in result["meta_info"]["output_token_logprobs"]
    ]


def test_each_rank_gives_the_same_bits(deterministic_dp2: ServerProcess) -> None:
    prompts = random_prompts([23, 70, 9], vocab=4000, seed=3)
    others = random_prompts([40, 90, 12, 61], vocab=4000, seed=4)
    for params in (PARAMS, SAMPLED):
        alone = [_completion(_generate(deterministic_dp2, p, 0, params)) for p in prompts]
        results: dict[int, dict] = {}
        # rank 1, each prompt beside the others in flight at once
        threads = [
            threading.Thread(target=_send, args=(deterministic_dp2, i, p, params, results))
            for i, p in enumerate(prompts + others)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert [results[i]["meta_info"]["dp_rank"] for i in range(len(prompts))] == [1] * len(
            prompts
        )
        for i, want in enumerate(alone):
            assert _completion(results[i]) == want, (
                f"prompt {i}, {params}: rank 1 in a batch != rank 0 alone"
            )
