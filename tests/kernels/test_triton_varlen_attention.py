"""Triton attention over packed variable-length segments (interpreted on the CPU) against the PyTorch reference,
and the reference against an explicit per-segment softmax(QK^T)V. q, k and v are views of one packed qkv tensor
(strided rows), as the vision tower makes them."""

from __future__ import annotations

import pytest
import torch

from sglang_lite.kernels import attention
from sglang_lite.kernels.attention import naive, triton_varlen

from .utils import assert_rel_close, poison_


def _packed_qkv(
    lengths: list[int], heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """q, k, v [T, H, hd] as views of one [T, 3, H, hd] tensor, and cu_seqlens (int32) of ``lengths``."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lengths), 3, heads, head_dim, generator=gen).to(dtype)
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0, dtype=torch.int32)
    return (*qkv.unbind(1), cu_seqlens)


def _explicit_attention(q, k, v, scale: float) -> torch.Tensor:
    """softmax(q k^T) v in fp64 for one segment; q, k, v [E, H, hd]."""
    q, k, v = (t.double().transpose(0, 1) for t in (q, k, v))
    probs = (q @ k.transpose(1, 2) * scale).softmax(-1)
    return (probs @ v).transpose(0, 1)


# segments of 1 and 130 rows (one or several query and key blocks), and one segment alone
LENGTHS = [[1, 17, 64, 130], [130]]


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_attention(nan_allocations, lengths, head_dim, dtype):
    q, k, v, cu_seqlens = _packed_qkv(lengths, 2, head_dim, dtype)
    want = attention.varlen_attention(q, k, v, cu_seqlens, head_dim**-0.5, backend="torch")
    got = attention.varlen_attention(q, k, v, cu_seqlens, head_dim**-0.5, backend="triton")
    assert_rel_close(got, want, dtype)


def test_reference_equals_explicit_softmax():
    lengths = [1, 17, 64]
    q, k, v, cu_seqlens = _packed_qkv(lengths, 2, 80, torch.float32)
    want = naive.varlen_attention(q, k, v, cu_seqlens, 0.1)
    for i, (start, end) in enumerate(zip(cu_seqlens.tolist(), cu_seqlens[1:].tolist())):
        explicit = _explicit_attention(q[start:end], k[start:end], v[start:end], 0.1)
        assert_rel_close(want[start:end], explicit, torch.float32, f"segment {i}")


def test_packed_segments_equal_each_segment_alone():
    """No query sees another segment's keys: the packed launch equals one launch a segment, bit for bit; int64
    bounds read as int32 ones."""
    lengths = [17, 1, 130]
    q, k, v, cu_seqlens = _packed_qkv(lengths, 2, 80, torch.float32)
    packed = triton_varlen.varlen_attention(q, k, v, cu_seqlens.long(), 0.1)
    for start, end in zip(cu_seqlens.tolist(), cu_seqlens[1:].tolist()):
        alone = triton_varlen.varlen_attention(
            q[start:end], k[start:end], v[start:end], torch.tensor([0, end - start]), 0.1
        )
        torch.testing.assert_close(packed[start:end], alone, rtol=0, atol=0)


def test_varlen_attention_writes_every_element_of_a_given_out():
    q, k, v, cu_seqlens = _packed_qkv([65, 3], 2, 80, torch.bfloat16)
    # a strided out: every other row of a buffer twice as tall
    out = poison_(torch.empty(2 * q.shape[0], *q.shape[1:], dtype=q.dtype))[::2]
    got = triton_varlen.varlen_attention(q, k, v, cu_seqlens, 0.1, out=out)
    assert got is out
    assert_rel_close(out, naive.varlen_attention(q, k, v, cu_seqlens, 0.1), torch.bfloat16)


def _refusals() -> list[tuple[str, dict]]:
    q, k, v, cu_seqlens = _packed_qkv([3, 5], 2, 64, torch.float32)
    return [
        ("q must be", dict(q=q[:, 0])),
        ("k must be", dict(k=k[:, :1])),
        ("v must be", dict(v=v.bfloat16())),
        # head dims strided
        ("v must be", dict(v=v.transpose(1, 2).contiguous().transpose(1, 2))),
        ("cu_seqlens must be 1-D", dict(cu_seqlens=cu_seqlens[None])),
        ("cu_seqlens must be 1-D int32 or int64", dict(cu_seqlens=cu_seqlens.float())),
        ("cu_seqlens must rise from 0 to T=8", dict(cu_seqlens=torch.tensor([0, 3, 7]))),
        ("cu_seqlens must rise from 0 to T=8", dict(cu_seqlens=torch.tensor([0, 5, 3, 8]))),
        ("out must be", dict(out=torch.empty(7, 2, 64))),
        ("out must be", dict(out=torch.empty(8, 2, 64, dtype=torch.bfloat16))),
    ]


@pytest.mark.parametrize("match,bad", _refusals())
def test_varlen_attention_names_the_bad_argument(match, bad):
    q, k, v, cu_seqlens = _packed_qkv([3, 5], 2, 64, torch.float32)
    args = dict(q=q, k=k, v=v, cu_seqlens=cu_seqlens, out=None) | bad
    with pytest.raises(ValueError, match=match):
        triton_varlen.varlen_attention(**args, scale=0.1)
