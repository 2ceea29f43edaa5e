"""Tensor, expert and DP-attention parallel forwards against the single-rank model, on gloo ranks of this machine.

The all-reduce changes the order of additions, so logits match within a float32 tolerance, not bit for bit.
Checkpoints are odd on purpose: a vocabulary that does not divide (padded), GQA, one KV head (replicated over the
ranks), more value heads than key heads in the Gated DeltaNet, MoE with and without the fused shared expert, dense.
"""

from __future__ import annotations

import multiprocessing
import queue as queue_module
import socket

import pytest
import torch

from sglang_lite.models.loader import load_model
from sglang_lite.server_args import ServerArgs
from tests.distributed.workers import run_rank
from tests.hf_checkpoints import make_hf_model, save_checkpoint

PROMPTS = [[3, 17, 42, 99, 150, 7, 61, 88, 120, 5, 33], [9, 140, 2, 77, 160, 12]]
TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(layout: dict, path: str, prompts: list, fusion: bool = True) -> list:
    """Each rank's logits (rank order); every process is reaped, whatever happens."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=run_rank, args=(r, port, layout, path, prompts[r], fusion, results), daemon=True
        )
        for r in range(len(prompts))
    ]
    for p in procs:
        p.start()
    try:
        out = {}
        for _ in procs:
            rank, value = results.get(timeout=TIMEOUT_S)
            assert not isinstance(value, str), f"rank {rank} failed:\n{value}"
            out[rank] = torch.as_tensor(value)
        return [out[r] for r in range(len(procs))]
    except queue_module.Empty:
        pytest.fail(f"a rank gave no result within {TIMEOUT_S} s")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def reference(path: str, prompt: list[int], fusion: bool = True) -> torch.Tensor:
    model = load_model(path, server_args=ServerArgs(disable_shared_experts_fusion=not fusion))
    return model(torch.tensor([prompt]))[0]


CHECKPOINTS = {
    "moe-odd-vocab": dict(moe=True, vocab_size=161),
    "moe-fusable": dict(moe=True, vocab_size=163, shared_expert_intermediate_size=24),
    "moe-one-kv-head": dict(moe=True, num_key_value_heads=1),
    "dense-odd-vocab": dict(moe=False, vocab_size=157, tie_word_embeddings=True),
    # four ways: 2 KV heads over 4 ranks (each shared by two), 4 key / 8 value GDN heads, vocab 162 padded to 164
    "moe-four-ways": dict(
        moe=True,
        vocab_size=162,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        shared_expert_intermediate_size=24,
    ),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, options in CHECKPOINTS.items():
        path = str(tmp_path_factory.mktemp(name))
        layout = "fused_experts" if name == "moe-fusable" else "text"
        save_checkpoint(make_hf_model(seed=1, **options), path, layout)
        out[name] = path
    return out


@pytest.mark.parametrize("name", [n for n in CHECKPOINTS if n != "moe-four-ways"])
def test_tp2_logits_match_tp1(checkpoints, name):
    path = checkpoints[name]
    prompt = PROMPTS[0]
    expected = reference(path, prompt)
    for logits in run_world({"tp_size": 2}, path, [prompt, prompt]):
        torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fusion", [True, False], ids=["fused-shared", "separate-shared"])
def test_ep2_logits_match_tp1(checkpoints, fusion):
    path = checkpoints["moe-fusable"]
    expected = reference(path, PROMPTS[0], fusion)
    for logits in run_world({"tp_size": 2, "ep_size": 2}, path, [PROMPTS[0]] * 2, fusion):
        torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("ep_size", [1, 2], ids=["tp4", "tp4-ep2"])
def test_four_ranks_match_tp1(checkpoints, ep_size):
    """tp4-ep2: experts split 2 ways and each expert's intermediate dimension 2 ways; the fused shared expert's
    quarter is zero-padded to the experts' half."""
    path = checkpoints["moe-four-ways"]
    expected = reference(path, PROMPTS[1])
    for logits in run_world({"tp_size": 4, "ep_size": ep_size}, path, [PROMPTS[1]] * 4):
        torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-4)


def test_dp_attention_ranks_run_their_own_tokens(checkpoints):
    """Two DP-attention ranks with different prompts (and lengths) share each layer's MoE: each gets its own
    prompt's logits."""
    path = checkpoints["moe-odd-vocab"]
    logits = run_world({"tp_size": 2, "dp_size": 2, "dp_attention": True}, path, PROMPTS)
    for prompt, got in zip(PROMPTS, logits):
        torch.testing.assert_close(got, reference(path, prompt), atol=2e-5, rtol=1e-4)


def test_idle_dp_attention_rank_joins_the_moe(checkpoints):
    """A DP rank with no tokens runs an empty forward; the busy rank's logits are unaffected."""
    path = checkpoints["moe-odd-vocab"]
    busy, idle = run_world(
        {"tp_size": 2, "dp_size": 2, "dp_attention": True}, path, [PROMPTS[0], None]
    )
    assert idle.shape == (0, 161)
    torch.testing.assert_close(busy, reference(path, PROMPTS[0]), atol=2e-5, rtol=1e-4)


def test_sizes_that_do_not_shard_name_the_size(checkpoints):
    path = checkpoints["moe-odd-vocab"]  # 2 key heads of the Gated DeltaNet cannot split 4 ways
    (error,) = {str(e) for e in _errors({"tp_size": 4}, path)}
    assert "linear_num_key_heads (2) is not divisible by the tp size (4)" in error


def _errors(layout: dict, path: str) -> list[str]:
    from sglang_lite.config import ModelConfig

    try:
        ModelConfig.from_hf(path).attention_shard(layout["tp_size"])
    except ValueError as error:
        return [error]
    return []
