"""Greedy generation of tensor-parallel worlds equals transformers ``generate`` (each prompt alone): the offline
``Engine(tp_size=2)`` and a ``--tp-size 2 --dp-size 2 --enable-dp-attention`` server on both DP ranks at once.

The checkpoints are odd on purpose: a vocabulary that does not divide by 2 (padded), GQA (4 query heads, 2 KV
heads), a Gated DeltaNet with 2 key and 4 value heads, MoE (fused shared expert) and dense (tied embeddings).
"""

from __future__ import annotations

import contextlib
import threading

import httpx
import pytest

from sglang_lite import Engine
from tests.hf_checkpoints import greedy_tokens, make_hf_model, save_checkpoint
from tests.server.conftest import start_server

NEW_TOKENS = 8
PROMPTS = [[5, 17, 42, 99, 150, 7, 61], [9, 140, 2, 77, 120, 12, 3, 3, 8, 31, 64, 100], [11] * 30]
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
KINDS = {
    "moe": dict(
        moe=True, vocab_size=161, shared_expert_intermediate_size=24
    ),  # fusable: 24 == moe intermediate
    "dense": dict(moe=False, vocab_size=157, tie_word_embeddings=True),
}


class Checkpoint:
    def __init__(self, root, kind: str) -> None:
        # wider weights than the default: logits far from ties, so greedy tokens do not flip on rounding
        self.model = make_hf_model(seed=3, initializer_range=0.1, **KINDS[kind])
        self.path = save_checkpoint(self.model, str(root / kind))

    def greedy(self, prompt: list[int]) -> list[int]:
        return greedy_tokens(self.model, prompt, NEW_TOKENS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("odd_checkpoints")
    return {kind: Checkpoint(root, kind) for kind in KINDS}


@pytest.mark.parametrize("kind", list(KINDS))
def test_engine_tp2_greedy_equals_transformers(checkpoints, kind):
    checkpoint = checkpoints[kind]
    with Engine(
        checkpoint.path,
        tp_size=2,
        cpu_threads_per_rank=1,
        skip_tokenizer_init=True,
        context_length=128,
        max_total_tokens=1024,
        max_running_requests=4,
        chunked_prefill_size=8,
    ) as engine:
        results = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [r["output_ids"] for r in results] == [checkpoint.greedy(p) for p in PROMPTS]


def test_dp_attention_server_greedy_equals_transformers_on_both_ranks(
    checkpoints, tmp_path_factory
):
    """Requests on both DP ranks at once: their batches meet (of different sizes, or one idle) in every MoE."""
    checkpoint = checkpoints["moe"]
    flags = [
        "--model-path",
        checkpoint.path,
        "--load-format",
        "auto",
        "--skip-tokenizer-init",
        "--tp-size",
        "2",
        "--dp-size",
        "2",
        "--enable-dp-attention",
        "--cpu-threads-per-rank",
        "1",
    ]
    jobs = [(rank, i) for rank in (0, 1) for i in range(len(PROMPTS))]
    results: dict = {}

    def post(url: str, rank: int, i: int) -> None:
        body = {"input_ids": PROMPTS[i], "sampling_params": GREEDY, "routed_dp_rank": rank}
        results[rank, i] = httpx.post(f"{url}/generate", json=body, timeout=120).json()

    with contextlib.contextmanager(start_server)(
        tmp_path_factory, "dpattn_parity", flags
    ) as server:
        threads = [threading.Thread(target=post, args=(server.url, rank, i)) for rank, i in jobs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)
    assert {job: results[job]["meta_info"]["dp_rank"] for job in jobs} == {
        job: job[0] for job in jobs
    }
    for rank, i in jobs:
        assert results[rank, i]["output_ids"] == checkpoint.greedy(PROMPTS[i]), (
            f"DP rank {rank}, prompt {i}"
        )
