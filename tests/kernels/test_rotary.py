"""Triton partial NeoX rotary (interpreted on the CPU) against the PyTorch reference and the transformers math."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import apply_rotary_pos_emb

from sglang_lite.kernels import rotary
from sglang_lite.kernels.rotary import naive

from .utils import assert_rel_close

MAX_POSITION = 4096


def _cos_sin_cache(rotary_dim: int, theta: float = 10000.0) -> torch.Tensor:
    inv_freq = theta ** -(torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.outer(torch.arange(MAX_POSITION, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _inputs(tokens: int, heads: int, num_kv: int, head_dim: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(tokens)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, num_kv, head_dim, generator=gen).to(dtype)
    return q, k, torch.randint(0, MAX_POSITION, (tokens,), generator=gen)


# (tokens, heads, kv_heads, head_dim, rotary_dim, dtype): Qwen3.5's quarter rotary (64 of 256, 20 of 80) and full
@pytest.mark.parametrize(
    "tokens,heads,num_kv,head_dim,rotary_dim,dtype",
    [
        (1, 4, 1, 256, 64, torch.float32),
        (7, 4, 2, 80, 20, torch.bfloat16),
        (300, 2, 2, 64, 16, torch.float32),
        (63, 8, 2, 128, 128, torch.bfloat16),
        (65, 3, 1, 80, 40, torch.float32),
    ],
)
def test_apply_rotary(nan_allocations, tokens, heads, num_kv, head_dim, rotary_dim, dtype):
    q, k, positions = _inputs(tokens, heads, num_kv, head_dim, dtype)
    q_in, k_in = q.clone(), k.clone()
    cache = _cos_sin_cache(rotary_dim)
    got_q, got_k = rotary.apply_rotary(q, k, positions, cache, rotary_dim, backend="triton")
    want_q, want_k = naive.apply_rotary(q, k, positions, cache, rotary_dim)
    assert_rel_close(got_q, want_q, dtype, "q")
    assert_rel_close(got_k, want_k, dtype, "k")
    assert torch.equal(
        got_q[..., rotary_dim:], q[..., rotary_dim:]
    )  # the tail passes through untouched
    assert torch.equal(q, q_in) and torch.equal(k, k_in)  # copies, not in place


def test_naive_rotary_matches_transformers():
    q, k, positions = _inputs(9, 4, 2, 80, torch.float32)
    cache = _cos_sin_cache(20)
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = (
        torch.cat([cos, cos], -1)[None],
        torch.cat([sin, sin], -1)[None],
    )  # HF repeats the halves
    # transformers applies partial rotary to [B, H, T, hd] with cos/sin [B, T, rotary_dim]
    want_q, want_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    got_q, got_k = naive.apply_rotary(q, k, positions, cache, 20)
    assert_rel_close(got_q, want_q[0].transpose(0, 1), torch.float32, "q")
    assert_rel_close(got_k, want_k[0].transpose(0, 1), torch.float32, "k")
