"""Triton fused MoE (interpreted on the CPU) against the PyTorch reference, and both against the transformers
Qwen3.5-MoE block math, including the shared expert fused in as expert E."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Qwen3_5MoeSparseMoeBlock,
    Qwen3_5MoeTopKRouter,
)

from sglang_lite.kernels import moe
from sglang_lite.kernels.moe import naive, triton_moe

from .utils import assert_rel_close

HIDDEN, INTER = 64, 32


def _randn(
    *shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, std: float = 1.0
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * std).to(dtype)


def _routing(num_tokens: int, num_experts: int, top_k: int, shared: bool, seed: int = 0):
    """Top-k routing over the routed experts, plus expert id E with a sigmoid weight when the shared one is fused."""
    weights, ids = naive.topk_softmax(_randn(num_tokens, num_experts, seed=seed), top_k)
    if shared:
        gate = torch.sigmoid(_randn(num_tokens, 1, seed=seed + 1))
        weights = torch.cat([weights, gate], 1)
        ids = torch.cat([ids, torch.full_like(ids[:, :1], num_experts)], 1)
    return weights, ids


def _explicit_moe(x, w13, w2, weights, ids) -> torch.Tensor:
    """Token by token, slot by slot, in fp64: the definition the grouped implementations must match."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += w * (w2[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
@pytest.mark.parametrize("num_experts,top_k", [(8, 1), (16, 2), (60, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax(num_tokens, num_experts, top_k, renormalize):
    logits = _randn(num_tokens, num_experts, seed=3)
    weights, ids = moe.topk_softmax(logits, top_k, renormalize, backend="triton")
    want_w, want_ids = naive.topk_softmax(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids, want_ids)
    assert_rel_close(weights, want_w, torch.float32, "weights")


def test_topk_softmax_matches_transformers_router():
    config = Qwen3_5MoeTextConfig(hidden_size=HIDDEN, num_experts=16, num_experts_per_tok=4)
    router = Qwen3_5MoeTopKRouter(config)
    router.weight.data = _randn(16, HIDDEN, seed=4)
    x = _randn(33, HIDDEN, seed=5)
    with torch.no_grad():
        logits, want_w, want_ids = router(x)
    for backend in ("triton", "torch"):
        weights, ids = moe.topk_softmax(logits, 4, backend=backend)
        assert torch.equal(ids.long(), want_ids), backend
        assert_rel_close(weights, want_w, torch.float32, f"{backend} weights")


# (tokens, experts, top_k, shared, dtype): every token count, expert count and top_k, with and without the fused
# shared expert, in both dtypes, without the full cartesian product (the interpreter is slow)
MOE_CASES = [
    (1, 8, 1, False, torch.float32),
    (1, 60, 8, True, torch.bfloat16),
    (7, 16, 2, True, torch.float32),
    (7, 8, 8, False, torch.bfloat16),
    (64, 60, 2, False, torch.float32),
    (64, 16, 8, True, torch.bfloat16),
    (300, 8, 2, True, torch.float32),
    (300, 16, 1, False, torch.bfloat16),
]


@pytest.mark.parametrize("num_tokens,num_experts,top_k,shared,dtype", MOE_CASES)
def test_fused_moe_triton_vs_naive(nan_allocations, num_tokens, num_experts, top_k, shared, dtype):
    total = num_experts + int(shared)
    x = _randn(num_tokens, HIDDEN, dtype=dtype, seed=1)
    w13 = _randn(total, 2 * INTER, HIDDEN, dtype=dtype, seed=2, std=0.1)
    w2 = _randn(total, HIDDEN, INTER, dtype=dtype, seed=3, std=0.1)
    weights, ids = _routing(num_tokens, num_experts, top_k, shared)
    got = moe.fused_moe(x, w13, w2, weights, ids, backend="triton")
    assert got.dtype == dtype
    assert_rel_close(got, naive.fused_moe(x, w13, w2, weights, ids), dtype)


# the first two run the one-token path; then one GEMM per expert; every expert on every token; the last two the
# padded bmm with the shared expert overflowing
@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,shared",
    [
        (1, 8, 1, True),
        (1, 16, 4, True),
        (7, 60, 8, False),
        (64, 16, 2, True),
        (300, 8, 2, True),
        (256, 16, 4, True),
    ],
)
def test_naive_fused_moe_vs_explicit_loop(num_tokens, num_experts, top_k, shared):
    total = num_experts + int(shared)
    x = _randn(num_tokens, HIDDEN, seed=1)
    w13, w2 = (
        _randn(total, 2 * INTER, HIDDEN, seed=2, std=0.1),
        _randn(total, HIDDEN, INTER, seed=3, std=0.1),
    )
    weights, ids = _routing(num_tokens, num_experts, top_k, shared)
    assert_rel_close(
        naive.fused_moe(x, w13, w2, weights, ids),
        _explicit_moe(x, w13, w2, weights, ids),
        torch.float32,
    )


def test_align_by_expert_groups_every_row_once():
    ids = _routing(37, 8, 3, shared=True)[1]
    sorted_rows, block_expert, num_padded = triton_moe.align_by_expert(ids, 9, triton_moe.BLOCK_M)
    used = int(num_padded)
    assert used % triton_moe.BLOCK_M == 0
    rows = sorted_rows[:used].long()
    real = rows < ids.numel()
    assert torch.equal(
        rows[real].sort().values, torch.arange(ids.numel())
    )  # each (token, slot) exactly once
    block_of_row = torch.arange(used) // triton_moe.BLOCK_M
    assert torch.equal(ids.reshape(-1)[rows[real]].long(), block_expert[block_of_row[real]].long())
    assert (block_expert[used // triton_moe.BLOCK_M :] == -1).all()


def _hf_block(num_experts: int, top_k: int) -> Qwen3_5MoeSparseMoeBlock:
    config = Qwen3_5MoeTextConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTER,
        shared_expert_intermediate_size=INTER,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
    )
    block = Qwen3_5MoeSparseMoeBlock(config)
    for i, p in enumerate(block.parameters()):
        p.data = _randn(*p.shape, seed=10 + i, std=0.1)
    return block


def _fused_shared_forward(
    block: Qwen3_5MoeSparseMoeBlock, x: torch.Tensor, top_k: int, backend: str
) -> torch.Tensor:
    """Our fused path: top-k routing, the shared expert appended as expert E, one fused_moe call."""
    shared = block.shared_expert
    w13 = torch.cat(
        [
            block.experts.gate_up_proj,
            torch.cat([shared.gate_proj.weight, shared.up_proj.weight])[None],
        ]
    )
    w2 = torch.cat([block.experts.down_proj, shared.down_proj.weight[None]])
    weights, ids = moe.topk_softmax(F.linear(x, block.gate.weight), top_k, backend=backend)
    weights = torch.cat(
        [weights, torch.sigmoid(F.linear(x, block.shared_expert_gate.weight)).float()], 1
    )
    ids = torch.cat([ids, torch.full_like(ids[:, :1], block.experts.num_experts)], 1)
    return moe.fused_moe(x, w13, w2, weights, ids, backend=backend)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (64, 16, 4)])
def test_fused_shared_expert_matches_transformers_block(backend, num_tokens, num_experts, top_k):
    block = _hf_block(num_experts, top_k)
    x = _randn(num_tokens, HIDDEN, seed=7)
    with torch.no_grad():
        want = block(x[None])[0]
        got = _fused_shared_forward(block, x, top_k, backend)
    assert_rel_close(got, want, torch.float32)


def test_fused_moe_rejects_bad_shapes():
    x, w13, w2 = (
        torch.zeros(4, HIDDEN),
        torch.zeros(3, 2 * INTER, HIDDEN),
        torch.zeros(3, HIDDEN, INTER + 1),
    )
    weights, ids = torch.ones(4, 1), torch.zeros(4, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="w2"):
        moe.fused_moe(x, w13, w2, weights, ids, backend="triton")
    with pytest.raises(ValueError, match="topk_weights"):
        moe.fused_moe(x, w13, w2[..., :INTER], weights[:2], ids, backend="triton")
