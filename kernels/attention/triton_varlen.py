"""Triton attention over packed variable-length segments, without a KV pool: the vision tower's.

q, k, v [T, H, hd] (rows possibly strided: views of one packed qkv tensor) hold S segments back to back; segment
s is rows ``cu_seqlens[s]`` .. ``cu_seqlens[s + 1]``, and each of its queries attends to all of its keys (not
causal; no GQA: q, k and v have the same heads). Softmax is the online (flash) form in fp32 with exp2, as in
``triton_attention``'s extend kernel; head dims that are not powers of two (72, 80) are masked up to the next one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import dot_precision, triton_interpreting
from ..triton_utils import attend_block

_LOG2E = 1.4426950408889634


@triton.jit
def _varlen_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    cu_seqlens_ptr,
    scale_log2,
    head_dim,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    segment = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + segment)
    length = (tl.load(cu_seqlens_ptr + segment + 1) - start).to(tl.int32)
    if m_block * BLOCK_M >= length:
        return
    # the segment's first row in 64 bits (T rows of packed qkv may pass 2**31 elements); offsets inside it in 32
    start = start.to(tl.int64)
    q_seg = q_ptr + start * stride_qt + head * stride_qh
    k_seg = k_ptr + start * stride_kt + head * stride_kh
    v_seg = v_ptr + start * stride_vt + head * stride_vh
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # query index inside this segment
    dims = tl.arange(0, BLOCK_D)
    row_ok, dim_ok = rows < length, dims < head_dim
    q = tl.load(
        q_seg + rows[:, None] * stride_qt + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    zero_scores = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for n0 in range(0, length, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < length
        kv_mask = col_ok[:, None] & dim_ok[None, :]
        k = tl.load(
            k_seg + cols[:, None] * stride_kt + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_seg + cols[:, None] * stride_vt + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        m_i, l_i, acc = attend_block(
            q, k, v, col_ok[None, :], m_i, l_i, acc, zero_scores, scale_log2, UPCAST, PRECISION
        )
    out = acc / l_i[:, None]
    out_seg = out_ptr + start * stride_ot + head * stride_oh
    tl.store(
        out_seg + rows[:, None] * stride_ot + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def _check_varlen_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    out: torch.Tensor | None,
) -> list[int]:
    """The segment bounds, read back once (they size the grid); a malformed argument raises ValueError naming it."""
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(
            f"q must be [T, H, hd] with contiguous head dims, got {tuple(q.shape)} strides {q.stride()}"
        )
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape or t.dtype != q.dtype or t.stride(2) != 1:
            raise ValueError(
                f"{name} must be q's {tuple(q.shape)} {q.dtype} with contiguous head dims, got "
                f"{tuple(t.shape)} {t.dtype} strides {t.stride()}"
            )
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1):
        raise ValueError(
            f"out must be {tuple(q.shape)} {q.dtype} with contiguous head dims, "
            f"got {tuple(out.shape)} {out.dtype}"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seqlens must be 1-D int32 or int64 [S + 1], got {tuple(cu_seqlens.shape)} "
            f"{cu_seqlens.dtype}"
        )
    bounds = cu_seqlens.tolist()
    rising = all(a <= b for a, b in zip(bounds, bounds[1:]))
    if not bounds or bounds[0] != 0 or bounds[-1] != q.shape[0] or not rising:
        shown = bounds if len(bounds) <= 9 else [*bounds[:8], "...", bounds[-1]]
        raise ValueError(f"cu_seqlens must rise from 0 to T={q.shape[0]}, got {shown}")
    return bounds


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each segment of the packed q, k, v attends to itself, not causally.

    Args:
        q, k, v: [T, H, hd], one dtype; rows may be strided, head dims contiguous.
        cu_seqlens: [S + 1] int32 or int64, rising from 0 to T: segment s is rows ``cu_seqlens[s]`` ..
            ``cu_seqlens[s + 1]``.
        scale: the factor of q k^T before the softmax (``hd ** -0.5`` for the usual attention).
        out: [T, H, hd] in q's dtype, head dims contiguous; allocated when not given.
    Returns:
        out [T, H, hd].
    """
    bounds = _check_varlen_args(q, k, v, cu_seqlens, out)
    out = torch.empty_like(q) if out is None else out
    longest = max((b - a for a, b in zip(bounds, bounds[1:])), default=0)
    if longest == 0:
        return out
    # the extend kernel's tiles: 64 x 64 up to 256 bytes of head per row, 32 x 32 above (MI300's shared memory,
    # sm_90's register spills; benchmarks/triton_resources.py)
    block_d = triton.next_power_of_2(q.shape[2])
    block_m, block_n = (32, 32) if block_d * q.element_size() > 256 else (64, 64)
    _varlen_kernel[(len(bounds) - 1, q.shape[1], triton.cdiv(longest, block_m))](
        q_ptr=q,
        k_ptr=k,
        v_ptr=v,
        out_ptr=out,
        cu_seqlens_ptr=cu_seqlens,
        scale_log2=scale * _LOG2E,
        head_dim=q.shape[2],
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_kt=k.stride(0),
        stride_kh=k.stride(1),
        stride_vt=v.stride(0),
        stride_vh=v.stride(1),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        UPCAST=triton_interpreting(),
        PRECISION=dot_precision(q.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    return out
