"""Triton partial NeoX rotary embedding: rotate_half on the first ``rotary_dim`` dims of every q and k head.

One program handles one token: it reads the token's cos/sin row once and rotates all its q and k heads. The
dims past ``rotary_dim`` are copied unchanged, so the outputs are complete new tensors like the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    cos,
    sin,
    num_heads,
    head_dim,
    stride_st,
    stride_sh,
    stride_dt,
    stride_dh,
    token,
    half_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < num_heads
    src = src_ptr + token * stride_st + heads[:, None] * stride_sh
    dst = dst_ptr + token * stride_dt + heads[:, None] * stride_dh
    # the unrotated tail is copied; the two stores never touch the same element (no ordering needed)
    tail = head_ok[:, None] & (dims[None, :] >= 2 * half_dim) & (dims[None, :] < head_dim)
    tl.store(dst + dims[None, :], tl.load(src + dims[None, :], mask=tail), mask=tail)
    half = tl.arange(0, BLOCK_HALF)
    mask = head_ok[:, None] & (half[None, :] < half_dim)
    x1 = tl.load(src + half[None, :], mask=mask).to(tl.float32)
    x2 = tl.load(src + half_dim + half[None, :], mask=mask).to(tl.float32)
    out_ty = dst_ptr.dtype.element_ty
    tl.store(dst + half[None, :], (x1 * cos[None, :] - x2 * sin[None, :]).to(out_ty), mask=mask)
    tl.store(
        dst + half_dim + half[None, :],
        (x2 * cos[None, :] + x1 * sin[None, :]).to(out_ty),
        mask=mask,
    )


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    positions_ptr,
    cache_ptr,
    num_q_heads,
    num_k_heads,
    head_dim,
    half_dim,
    stride_cache,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    half = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cache_ptr + pos * stride_cache + half, mask=half < half_dim, other=0.0).to(
        tl.float32
    )
    sin = tl.load(
        cache_ptr + pos * stride_cache + half_dim + half, mask=half < half_dim, other=0.0
    ).to(tl.float32)
    _rotate_heads(
        q_ptr,
        q_out_ptr,
        cos,
        sin,
        num_q_heads,
        head_dim,
        stride_qt,
        stride_qh,
        stride_qot,
        stride_qoh,
        token,
        half_dim,
        BLOCK_HQ,
        BLOCK_HALF,
        BLOCK_D,
    )
    _rotate_heads(
        k_ptr,
        k_out_ptr,
        cos,
        sin,
        num_k_heads,
        head_dim,
        stride_kt,
        stride_kh,
        stride_kot,
        stride_koh,
        token,
        half_dim,
        BLOCK_HK,
        BLOCK_HALF,
        BLOCK_D,
    )


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
):
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q [T, H, hd] and k [T, KV, hd] must agree, got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("q and k must have contiguous head dims (stride 1 on the last axis)")
    if positions.shape != (q.shape[0],):
        raise ValueError(f"positions must be [T={q.shape[0]}], got {tuple(positions.shape)}")
    if rotary_dim % 2 or not 0 < rotary_dim <= q.shape[2]:
        raise ValueError(
            f"rotary_dim must be even and in (0, head_dim={q.shape[2]}], got {rotary_dim}"
        )
    if (
        cos_sin_cache.dim() != 2
        or cos_sin_cache.shape[1] != rotary_dim
        or cos_sin_cache.stride(1) != 1
    ):
        raise ValueError(
            f"cos_sin_cache must be [max_position, rotary_dim={rotary_dim}] with contiguous rows, "
            f"got {tuple(cos_sin_cache.shape)}"
        )


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, hd], k [T, KV, hd], positions [T] -> rotated copies of q and k."""
    _check(q, k, positions, cos_sin_cache, rotary_dim)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.shape[0] == 0:
        return q_out, k_out
    _rotary_kernel[(q.shape[0],)](
        q_ptr=q,
        k_ptr=k,
        q_out_ptr=q_out,
        k_out_ptr=k_out,
        positions_ptr=positions,
        cache_ptr=cos_sin_cache,
        num_q_heads=q.shape[1],
        num_k_heads=k.shape[1],
        head_dim=q.shape[2],
        half_dim=rotary_dim // 2,
        stride_cache=cos_sin_cache.stride(0),
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_kt=k.stride(0),
        stride_kh=k.stride(1),
        stride_qot=q_out.stride(0),
        stride_qoh=q_out.stride(1),
        stride_kot=k_out.stride(0),
        stride_koh=k_out.stride(1),
        BLOCK_HALF=triton.next_power_of_2(rotary_dim // 2),
        BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_D=triton.next_power_of_2(q.shape[2]),
    )
    return q_out, k_out
