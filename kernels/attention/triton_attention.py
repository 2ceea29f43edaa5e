"""Triton paged attention: store, extend (prefill) and split-K decode.

Pool: k_cache, v_cache [N, KV, hd], rows possibly strided (per-layer views of a pool that keeps a slot's layers
together), slots in pages of PAGE: position ``pos`` of request ``row`` lives in slot
``page_table[row, pos // PAGE] * PAGE + pos % PAGE``. Every key and value is read through the page table, so prefix
and new tokens take the same path. Softmax is the
online (flash) form in fp32 with exp2; head dims that are not powers of two (80) are masked up to the next one.
Query head h reads KV head h // (H / KV) (GQA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import dot_precision, triton_interpreting
from ..triton_utils import attend_block

_LOG2E = 1.4426950408889634
# Decode splits each request's context into this many chunks (flash decoding) so short batches fill the GPU.
DECODE_SPLITS = 8


@triton.jit
def _store_kv_kernel(
    k_cache_ptr,
    v_cache_ptr,
    loc_ptr,
    k_ptr,
    v_ptr,
    row_size,
    stride_cache,
    stride_k,
    stride_v,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(loc_ptr + token).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_size
    k = tl.load(k_ptr + token * stride_k + offs, mask=mask)
    v = tl.load(v_ptr + token * stride_v + offs, mask=mask)
    tl.store(
        k_cache_ptr + slot * stride_cache + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask
    )
    tl.store(
        v_cache_ptr + slot * stride_cache + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask
    )


def _check_pool(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache and v_cache must be equal [N, KV, hd], got {tuple(k_cache.shape)} {k_cache.dtype}, "
            f"{tuple(v_cache.shape)} {v_cache.dtype}"
        )
    row = (k_cache.shape[2], 1)
    if k_cache.stride() != v_cache.stride() or k_cache.stride()[1:] != row:
        raise ValueError(
            "k_cache and v_cache must have contiguous [KV, hd] rows and equal strides, got "
            f"{k_cache.stride()} and {v_cache.stride()}"
        )


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write k, v [T, KV, hd] into the pool rows ``loc`` [T]."""
    _check_pool(k_cache, v_cache)
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[1:] or loc.shape != (k.shape[0],):
        raise ValueError(
            f"k, v must be [T, KV, hd]={tuple(k_cache.shape[1:])} with loc [T], got k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}, loc {tuple(loc.shape)}"
        )
    if (
        k.stride(2) != 1
        or k.stride(1) != k.shape[2]
        or v.stride(2) != 1
        or v.stride(1) != v.shape[2]
    ):
        raise ValueError("k and v must have contiguous [KV, hd] rows")
    if k.shape[0] == 0:
        return
    row_size, block = k.shape[1] * k.shape[2], 1024
    _store_kv_kernel[(k.shape[0], triton.cdiv(row_size, block))](
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        loc_ptr=loc,
        k_ptr=k,
        v_ptr=v,
        row_size=row_size,
        stride_cache=k_cache.stride(0),
        stride_k=k.stride(0),
        stride_v=v.stride(0),
        BLOCK=block,
    )


@triton.jit
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    page_table_ptr,
    req_pool_ptr,
    prefix_ptr,
    extend_ptr,
    q_start_ptr,
    scale_log2,
    head_dim,
    group,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cn,
    stride_ch,
    stride_req,
    PAGE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    extend = tl.load(extend_ptr + req)
    if m_block * BLOCK_M >= extend:
        return
    prefix = tl.load(prefix_ptr + req)
    q_start = tl.load(q_start_ptr + req)
    page_map = page_table_ptr + tl.load(req_pool_ptr + req).to(tl.int64) * stride_req
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # query index inside this request's new tokens
    dims = tl.arange(0, BLOCK_D)
    row_ok, dim_ok = rows < extend, dims < head_dim
    q = tl.load(
        q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    kv_head = (head // group).to(tl.int64) * stride_ch
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    zero_scores = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # causal: the last query row of this block sees positions up to prefix + its index
    kv_end = tl.minimum(prefix + (m_block + 1) * BLOCK_M, prefix + extend)
    for n0 in range(0, kv_end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < kv_end
        pages = tl.load(page_map + cols // PAGE, mask=col_ok, other=0).to(tl.int64)
        slots = pages * PAGE + cols % PAGE
        kv_mask = col_ok[:, None] & dim_ok[None, :]
        k = tl.load(
            k_cache_ptr + slots[:, None] * stride_cn + kv_head + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr + slots[:, None] * stride_cn + kv_head + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        visible = col_ok[None, :] & (cols[None, :] <= prefix + rows[:, None])
        m_i, l_i, acc = attend_block(
            q, k, v, visible, m_i, l_i, acc, zero_scores, scale_log2, UPCAST, PRECISION
        )
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def _check_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    out: torch.Tensor | None,
    page_size: int,
) -> None:
    _check_pool(k_cache, v_cache)
    if page_size < 1 or k_cache.shape[0] % page_size:
        raise ValueError(
            f"page_size must be >= 1 and divide the pool's {k_cache.shape[0]} slots, got {page_size}"
        )
    if (
        q.dim() != 3
        or q.shape[2] != k_cache.shape[2]
        or q.shape[1] % k_cache.shape[1]
        or q.stride(2) != 1
    ):
        raise ValueError(
            f"q must be [*, H, hd={k_cache.shape[2]}] with H a multiple of KV={k_cache.shape[1]} and "
            f"contiguous head dims, got {tuple(q.shape)}"
        )
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q ({q.dtype}) and the KV pool ({k_cache.dtype}) must share a dtype")
    if page_table.dim() != 2 or page_table.stride(1) != 1:
        raise ValueError(
            f"page_table must be [R, max_pages] with contiguous rows, got {tuple(page_table.shape)}"
        )
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1):
        raise ValueError(
            f"out must be {tuple(q.shape)} {q.dtype} with contiguous head dims, "
            f"got {tuple(out.shape)} {out.dtype}"
        )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    scale: float,
    *,
    page_size: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """New tokens ([T, H, hd], packed by request) attend causally to their request's prefix and to themselves."""
    _check_attention_args(q, k_cache, v_cache, page_table, out, page_size)
    num_reqs = req_pool_indices.numel()
    if prefix_lens.shape != (num_reqs,) or extend_lens.shape != (num_reqs,):
        raise ValueError(
            f"prefix_lens and extend_lens must be [R={num_reqs}], got {tuple(prefix_lens.shape)}, "
            f"{tuple(extend_lens.shape)}"
        )
    out = torch.empty_like(q) if out is None else out
    if num_reqs == 0 or q.shape[0] == 0:
        return out
    q_start = torch.cumsum(extend_lens, 0) - extend_lens
    # 64 x 64 tiles up to 256 bytes of head per row (bf16 head_dim 128); wider rows take 32 x 32, which keeps fp32
    # within MI300's 64 KB of shared memory and nearly removes its register spills on sm_90
    # (benchmarks/triton_resources.py; the figures: docs/performance.md)
    block_d = triton.next_power_of_2(q.shape[2])
    block_m, block_n = (32, 32) if block_d * q.element_size() > 256 else (64, 64)
    max_extend = int(extend_lens.max())  # one host read to size the grid
    _extend_kernel[(num_reqs, q.shape[1], triton.cdiv(max_extend, block_m))](
        q_ptr=q,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        out_ptr=out,
        page_table_ptr=page_table,
        req_pool_ptr=req_pool_indices,
        prefix_ptr=prefix_lens,
        extend_ptr=extend_lens,
        q_start_ptr=q_start,
        scale_log2=scale * _LOG2E,
        head_dim=q.shape[2],
        group=q.shape[1] // k_cache.shape[1],
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_cn=k_cache.stride(0),
        stride_ch=k_cache.stride(1),
        stride_req=page_table.stride(0),
        PAGE=page_size,
        UPCAST=triton_interpreting(),
        PRECISION=dot_precision(q.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    return out


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    part_out_ptr,
    part_lse_ptr,
    page_table_ptr,
    req_pool_ptr,
    seq_lens_ptr,
    scale_log2,
    head_dim,
    group,
    stride_qb,
    stride_qh,
    stride_cn,
    stride_ch,
    stride_req,
    PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    # each split takes a whole number of BLOCK_N chunks of the context
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start, end = split * split_len, tl.minimum((split + 1) * split_len, seq_len)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q = tl.load(q_ptr + req * stride_qb + head * stride_qh + dims, mask=dim_ok, other=0.0).to(
        tl.float32
    )
    page_map = page_table_ptr + tl.load(req_pool_ptr + req).to(tl.int64) * stride_req
    kv_head = (head // group).to(tl.int64) * stride_ch
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        pages = tl.load(page_map + cols // PAGE, mask=col_ok, other=0).to(tl.int64)
        slots = pages * PAGE + cols % PAGE
        kv_mask = col_ok[:, None] & dim_ok[None, :]
        k = tl.load(
            k_cache_ptr + slots[:, None] * stride_cn + kv_head + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr + slots[:, None] * stride_cn + kv_head + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = tl.sum(q[None, :] * k.to(tl.float32), axis=1) * scale_log2
        s = tl.where(col_ok, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp2(s - m_new)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        m_i = m_new
    part = (req * tl.num_programs(1) + head) * NUM_SPLITS + split
    empty = end <= start  # short contexts leave trailing splits without keys
    l_safe = tl.where(empty, 1.0, l_i)
    tl.store(part_out_ptr + part * BLOCK_D + dims, acc / l_safe)
    tl.store(part_lse_ptr + part, tl.where(empty, -float("inf"), m_i + tl.log2(l_safe)))


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    head_dim,
    stride_ob,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    req, head = tl.program_id(0), tl.program_id(1)
    part = (req * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    lse = tl.load(part_lse_ptr + part)
    weights = tl.exp2(lse - tl.max(lse, axis=0))  # empty splits have lse = -inf and weigh 0
    dims = tl.arange(0, BLOCK_D)
    parts = tl.load(part_out_ptr + part[:, None] * BLOCK_D + dims[None, :])
    out = tl.sum(weights[:, None] * parts, axis=0) / tl.sum(weights, axis=0)
    tl.store(
        out_ptr + req * stride_ob + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < head_dim,
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    page_size: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per request ([B, H, hd]) over its first ``seq_lens`` (>= 1) cached tokens; split-K then merge."""
    _check_attention_args(q, k_cache, v_cache, page_table, out, page_size)
    batch = q.shape[0]
    num_heads, head_dim = q.shape[1:]
    if req_pool_indices.shape != (batch,) or seq_lens.shape != (batch,):
        raise ValueError(
            f"req_pool_indices and seq_lens must be [B={batch}], got {tuple(req_pool_indices.shape)}, "
            f"{tuple(seq_lens.shape)}"
        )
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    part_out = torch.empty(
        batch, num_heads, DECODE_SPLITS, block_d, dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty(batch, num_heads, DECODE_SPLITS, dtype=torch.float32, device=q.device)
    common = dict(head_dim=head_dim, NUM_SPLITS=DECODE_SPLITS, BLOCK_D=block_d)
    _decode_split_kernel[(batch, num_heads, DECODE_SPLITS)](
        q_ptr=q,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        part_out_ptr=part_out,
        part_lse_ptr=part_lse,
        page_table_ptr=page_table,
        req_pool_ptr=req_pool_indices,
        seq_lens_ptr=seq_lens,
        scale_log2=scale * _LOG2E,
        group=num_heads // k_cache.shape[1],
        stride_qb=q.stride(0),
        stride_qh=q.stride(1),
        stride_cn=k_cache.stride(0),
        stride_ch=k_cache.stride(1),
        stride_req=page_table.stride(0),
        PAGE=page_size,
        BLOCK_N=64,
        **common,
    )
    _decode_reduce_kernel[(batch, num_heads)](
        part_out_ptr=part_out,
        part_lse_ptr=part_lse,
        out_ptr=out,
        stride_ob=out.stride(0),
        stride_oh=out.stride(1),
        **common,
    )
    return out
