"""Triton batch invariant matmul: ``x @ W^T`` whose every output row is computed the same way at any row count.

cuBLAS picks its kernel, tiles and split of K from the whole problem's shape, M included, so a token's row changes
with the batch around it. Here the tiles come from the data type alone, K is never split, and each program walks
K from 0 up one ``BLOCK_K`` slice at a time into one fp32 accumulator: a row's sums are the same additions in the
same order whether it is computed alone or among thousands (SGLang's batch invariant ops do the same with a
persistent kernel). A block-FP8 weight is dequantized tile by tile in registers (weight times its block's scale,
rounded to x's dtype as ``naive.linear`` does), x itself is not quantized.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..dispatch import dot_precision, triton_interpreting
from ..triton_utils import dot_accumulate


class Tiles(NamedTuple):
    """One launch's tile shape and warps: a function of x's dtype only, never of the row count."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int


# 16-bit operands take 64-deep K slices; float32 ones (three tf32 products on NVIDIA) half as deep, for registers
_TILES = {
    torch.bfloat16: Tiles(64, 64, 64, 4),
    torch.float16: Tiles(64, 64, 64, 4),
    torch.float32: Tiles(64, 64, 32, 4),
}


@triton.jit
def _linear_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    num_rows,
    num_cols,
    depth,
    stride_xm,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    stride_om,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < num_rows, cols < num_cols
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, depth, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < depth
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w = tl.load(w_cols + ks[:, None].to(tl.int64) * stride_wk, mask=w_mask, other=0.0)
        if HAS_SCALE:
            block_scale = tl.load(
                scale_ptr
                + (cols // SCALE_N)[None, :] * stride_sn
                + (ks // SCALE_K)[:, None] * stride_sk,
                mask=w_mask,
                other=0.0,
            )
            w = w.to(tl.float32) * block_scale
        acc = dot_accumulate(x, w.to(x.dtype), acc, UPCAST, PRECISION)
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """x [M, K] (float32, bf16 or fp16, rows contiguous) times weight [N, K] in any layout (a float dtype, widened
    or rounded to x's in registers; or FP8 with float32 ``weight_scale`` [ceil(N / bn), ceil(K / bk)] over
    ``block`` = (bn, bk)) -> [M, N] in x's dtype."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with contiguous rows, got shape {tuple(x.shape)}")
    if x.dtype not in _TILES:
        raise ValueError(f"x must be one of {sorted(map(str, _TILES))}, got {x.dtype}")
    num_rows, depth = x.shape
    num_cols = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != depth:
        raise ValueError(f"weight must be [N, K={depth}], got {tuple(weight.shape)}")
    scale_n, scale_k = block if weight_scale is not None else (1, 1)
    out = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    tiles = _TILES[x.dtype]
    grid = (triton.cdiv(num_rows, tiles.block_m), triton.cdiv(num_cols, tiles.block_n))
    _linear_kernel[grid](
        x_ptr=x,
        w_ptr=weight,
        scale_ptr=weight if weight_scale is None else weight_scale,
        out_ptr=out,
        num_rows=num_rows,
        num_cols=num_cols,
        depth=depth,
        stride_xm=x.stride(0),
        stride_wn=weight.stride(0),
        stride_wk=weight.stride(1),
        stride_sn=0 if weight_scale is None else weight_scale.stride(0),
        stride_sk=0 if weight_scale is None else weight_scale.stride(1),
        stride_om=out.stride(0),
        SCALE_N=scale_n,
        SCALE_K=scale_k,
        HAS_SCALE=weight_scale is not None,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        UPCAST=triton_interpreting(),
        PRECISION=dot_precision(x.dtype),
        num_warps=tiles.num_warps,
    )
    return out
