"""A block-FP8 checkpoint under tensor and expert parallelism.

Dequantized at load (the CPU path), each rank reads row or column slices of the FP8 tensors that may start and end
inside 128x128 blocks (and inside the 8x16 blocks of the second case), dequantizes them with the scales of the
blocks they touch, and the TP=2 logits match TP=1's. Kept FP8 in memory (the GPU layout, run here on the CPU), a
rank's shards must cover whole blocks: with 4x4 blocks every shard does and the TP=2 logits match TP=1's FP8 model;
with 8x16 blocks the experts' intermediate size (24, 12 a rank) cuts the 16-column blocks of ``down_proj``, which
every rank refuses at load (a second FP8 rounding otherwise), as upstream SGLang does.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
import traceback

import pytest
import torch

from sglang_lite.models.loader import load_model
from tests.distributed.test_tp_parity import PROMPTS, TIMEOUT_S, free_port, reference, run_world
from tests.hf_checkpoints import make_hf_model
from tests.models.test_fp8 import make_fp8_checkpoint

LAYOUTS = [{"tp_size": 2}, {"tp_size": 2, "ep_size": 2}]
LAYOUT_IDS = ["tp2", "tp2-ep2"]


@pytest.mark.parametrize("block", [(128, 128), (8, 16)], ids=["block128", "block8x16"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_fp8_checkpoint_tp2_logits_match_tp1(tmp_path, block, layout):
    hf = make_hf_model(moe=True, seed=1, vocab_size=161, shared_expert_intermediate_size=24)
    path = make_fp8_checkpoint(hf, str(tmp_path), "vl", block)
    prompt = PROMPTS[0]
    expected = reference(path, prompt)
    with torch.no_grad():
        assert (
            (expected - hf(torch.tensor([prompt])).logits[0]).abs().max() / expected.abs().max()
        ) < 1e-4
    for logits in run_world(layout, path, [prompt, prompt]):
        torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-4)


def fp8_rank(rank: int, port: int, layout: dict, path: str, prompt: list[int], results) -> None:
    """A rank that keeps the quantized weights FP8: puts (rank, logits of ``prompt``) or (rank, the error)."""
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    from sglang_lite.distributed import ParallelConfig, destroy_distributed, init_distributed

    try:
        init_distributed(ParallelConfig(**layout), rank, f"127.0.0.1:{port}", "cpu", timeout_s=60)
        model = load_model(path, quantized_weights=True)
        results.put((rank, model(torch.tensor([prompt]))[0]))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        destroy_distributed()


def run_fp8_world(layout: dict, path: str, prompt: list[int], ranks: int = 2) -> list:
    """Each rank's logits, or its traceback (a string), in rank order; every process is reaped."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=fp8_rank, args=(r, port, layout, path, prompt, results), daemon=True)
        for r in range(ranks)
    ]
    for p in procs:
        p.start()
    try:
        out = dict(results.get(timeout=TIMEOUT_S) for _ in procs)
        return [out[r] for r in range(ranks)]
    except queue_module.Empty:
        pytest.fail(f"a rank gave no result within {TIMEOUT_S} s")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_fp8_weights_in_memory_tp2_match_tp1_when_shards_cover_whole_blocks(tmp_path, layout):
    hf = make_hf_model(moe=True, seed=1, vocab_size=161, shared_expert_intermediate_size=24)
    path = make_fp8_checkpoint(hf, str(tmp_path), "vl", (4, 4))
    prompt = PROMPTS[0]
    expected = load_model(path, quantized_weights=True)(torch.tensor([prompt]))[0]
    for logits in run_fp8_world(layout, path, prompt):
        assert not isinstance(logits, str), logits
        torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-4)


def test_fp8_weights_in_memory_tp2_refuse_shards_that_cut_a_block(tmp_path):
    hf = make_hf_model(
        moe=True,
        seed=1,
        vocab_size=161,
        shared_expert_intermediate_size=24,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    )
    path = make_fp8_checkpoint(hf, str(tmp_path), "vl", (8, 16))
    errors = run_fp8_world({"tp_size": 2}, path, PROMPTS[0])
    for rank, error in enumerate(errors):
        assert isinstance(error, str) and "CheckpointError" in error, error
        columns = "0:12" if rank == 0 else "12:24"
        assert (
            "tensor 'model.language_model.layers.0.mlp.experts.0.down_proj.weight' (48, 24)"
            in error
        )
        assert "loads as block-FP8 in 8x16 blocks" in error
        assert f"columns {columns}: shard size (48, 12))" in error, error
