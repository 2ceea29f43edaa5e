"""Triton batch invariant matmul: ``x @ W^T`` whose every output row is computed the same way at any row count.

cuBLAS picks its kernel, tiles and split of K from the whole problem's shape, M included, so a token's row changes
with the batch around it. Here the tiles come from the data type alone, K is never split, and each program walks
K from 0 up one ``BLOCK_K`` slice at a time into one fp32 accumulator: a row's sums are the same additions in the
same order whether it is computed alone or among thousands (SGLang's batch invariant ops do the same with a
persistent kernel). The weight format is a constexpr: ``"plain"`` (a float dtype, any layout), ``"fp8"`` (block
FP8, dequantized tile by tile in registers: weight times its block's scale, rounded to x's dtype as
``naive.linear`` does) or ``"mxfp4"`` (``kernels/quant/mxfp4.py``'s packed e2m1 codes and e8m0 scales, see
``mxfp4_dot``); x itself is never quantized.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import dispatch
from ..dispatch import dot_precision, triton_interpreting
from ..triton_utils import row_dot_accumulate


class Tiles(NamedTuple):
    """One launch's tile shape and warps: a function of x's dtype only, never of the row count."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int


# 16-bit operands take 64-deep K slices; float32 ones (three tf32 products on NVIDIA) half as deep, for registers.
# Every depth is a whole number of MXFP4 groups (32).
_TILES = {
    torch.bfloat16: Tiles(64, 64, 64, 4),
    torch.float16: Tiles(64, 64, 64, 4),
    torch.float32: Tiles(64, 64, 32, 4),
}
MXFP4_GROUP = 32
# tl.dot_scaled's e2m1 operand with a 16-bit other side (gfx950 only, see ``mxfp4_dot_scaled``)
_DOT_SCALED_LHS = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_DOT_SCALED_TRITON = (3, 4)


def mxfp4_dot_scaled(dtype: torch.dtype) -> str | None:
    """The lhs format of ``tl.dot_scaled`` when MXFP4 products with x of ``dtype`` take it, else None (the
    dequantizing path): on gfx950 (MI355X), whose Triton lowers an e2m1 operand with its e8m0 scales to the
    scaled matrix cores' data path, from Triton 3.4 on; elsewhere a dequantized tile is as fast (Triton's own
    lowering there upcasts to bf16 too) and is the path the CPU tests check."""
    version = tuple(int(part) for part in triton.__version__.split(".")[:2])
    if dispatch.gpu_arch() != "gfx950" or version < _DOT_SCALED_TRITON:
        return None
    return _DOT_SCALED_LHS.get(dtype)


@triton.jit
def _e2m1_value(code):
    """The float32 value of e2m1 codes (uint8, 0-15): twice the magnitude is 0, 1, 2, 3, 4, 6, 8, 12."""
    magnitude = (code & 7).to(tl.int32)
    exponent = magnitude >> 1
    mantissa = magnitude & 1
    doubled = tl.where(exponent == 0, mantissa, (2 + mantissa) << tl.maximum(exponent - 1, 0))
    value = doubled.to(tl.float32) * 0.5
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def mxfp4_dot(
    acc,
    a,
    w_rows,
    s_rows,
    row_ok,
    k0,
    depth,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_SCALED: tl.constexpr,
):
    """``acc + a @ W[rows, k0:k0 + BLOCK_K]^T`` for an MXFP4 weight W of ``depth`` columns, a [M, BLOCK_K]: its
    rows' packed bytes start at the pointers ``w_rows`` [R], their e8m0 scales at ``s_rows`` [R].

    ``DOT_SCALED`` (a lhs format, see ``mxfp4_dot_scaled``) hands the bytes and scales to ``tl.dot_scaled``;
    otherwise the tile is dequantized in registers (code value times 2^(s - 127), exact in x's dtype) and
    multiplied in a's dtype. Triton's interpreter emulates ``tl.dot_scaled`` with numpy, so the CPU tests check
    what its operands mean (K-packed bytes, [N, K / 32] scales), not gfx950's instructions: those only a
    compile for gfx950 (benchmarks/triton_resources.py) and an MI355X (benchmarks/gpu_check.py) can show.
    """
    offsets = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    packed = tl.load(
        w_rows[:, None] + offsets[None, :],
        mask=row_ok[:, None] & (offsets < depth // 2)[None, :],
        other=0,
    )
    # a group past the end reads scale 1.0 (its codes read as 0)
    scale_bits = tl.load(
        s_rows[:, None] + groups[None, :],
        mask=row_ok[:, None] & (groups < tl.cdiv(depth, 32))[None, :],
        other=127,
    )
    if DOT_SCALED is not None:
        return tl.dot_scaled(a, None, DOT_SCALED, tl.trans(packed), scale_bits, "e2m1", acc)
    # e8m0 as float32 bits; code 0 (2^-127) is the one subnormal
    scales = tl.maximum(scale_bits.to(tl.int32) << 23, 0x400000).to(tl.float32, bitcast=True)
    # element 2j is the low nibble: joined on a last axis, (j, 0) and (j, 1) become 2j and 2j + 1
    values = tl.join(_e2m1_value(packed & 15), _e2m1_value(packed >> 4))
    grouped = tl.reshape(values, (w_rows.shape[0], BLOCK_K // 32, 32)) * scales[:, :, None]
    w = tl.reshape(grouped, (w_rows.shape[0], BLOCK_K)).to(a.dtype)
    return row_dot_accumulate(a, tl.trans(w), acc, UPCAST, PRECISION)


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
    WEIGHT_FORMAT: tl.constexpr,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_SCALED: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < num_rows, cols < num_cols
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + cols.to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, depth, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < depth
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if WEIGHT_FORMAT == "mxfp4":
            s_rows = scale_ptr + cols.to(tl.int64) * stride_sn
            acc = mxfp4_dot(
                acc, x, w_rows, s_rows, col_ok, k0, depth, BLOCK_K, UPCAST, PRECISION, DOT_SCALED
            )
        else:
            w_mask = k_ok[:, None] & col_ok[None, :]
            w_tile = w_rows[None, :] + ks[:, None].to(tl.int64) * stride_wk
            w = tl.load(w_tile, mask=w_mask, other=0.0)
            if WEIGHT_FORMAT == "fp8":
                block_scale = tl.load(
                    scale_ptr
                    + (cols // SCALE_N)[None, :] * stride_sn
                    + (ks // SCALE_K)[:, None] * stride_sk,
                    mask=w_mask,
                    other=0.0,
                )
                w = w.to(tl.float32) * block_scale
            acc = row_dot_accumulate(x, w.to(x.dtype), acc, UPCAST, PRECISION)
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def _check_x(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with contiguous rows, got shape {tuple(x.shape)}")
    if x.dtype not in _TILES:
        raise ValueError(f"x must be one of {sorted(map(str, _TILES))}, got {x.dtype}")


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """x [M, K] (float32, bf16 or fp16, rows contiguous) times weight [N, K] in any layout (a float dtype, widened
    or rounded to x's in registers; or FP8 with float32 ``weight_scale`` [ceil(N / bn), ceil(K / bk)] over
    ``block`` = (bn, bk)) -> [M, N] in x's dtype."""
    _check_x(x)
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be [N, K={x.shape[1]}], got {tuple(weight.shape)}")
    if weight_scale is None:
        return _launch(x, weight, weight, "plain", (1, 1), (weight.stride(1), 0, 0))
    strides = (weight.stride(1), weight_scale.stride(0), weight_scale.stride(1))
    return _launch(x, weight, weight_scale, "fp8", block, strides)


def linear_mxfp4(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (float32, bf16 or fp16, rows contiguous) times an MXFP4 weight W [N, K]: ``weight`` uint8
    [N, K / 2] (two e2m1 codes a byte, element 2j in the low nibble) and ``scale`` uint8 [N, ceil(K / 32)]
    (e8m0), rows contiguous -> [M, N] in x's dtype. Weight-only: x is not quantized."""
    _check_x(x)
    if weight.shape[1] * 2 != x.shape[1] or weight.stride(1) != 1 or scale.stride(1) != 1:
        raise ValueError(
            f"MXFP4 weight must be [N, K / 2 = {x.shape[1] // 2}] and its scales [N, ceil(K / 32)] with "
            f"contiguous rows, got {tuple(weight.shape)} and {tuple(scale.shape)}"
        )
    return _launch(x, weight, scale, "mxfp4", (1, MXFP4_GROUP), (1, scale.stride(0), 1))


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    weight_format: str,
    block: tuple[int, int],
    strides: tuple[int, int, int],
) -> torch.Tensor:
    """Run the kernel; ``strides``: the weight's along K, the scale's along N and along K."""
    num_rows, depth = x.shape
    num_cols = weight.shape[0]
    out = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    tiles = _TILES[x.dtype]
    grid = (triton.cdiv(num_rows, tiles.block_m), triton.cdiv(num_cols, tiles.block_n))
    _linear_kernel[grid](
        x_ptr=x,
        w_ptr=weight,
        scale_ptr=scale,
        out_ptr=out,
        num_rows=num_rows,
        num_cols=num_cols,
        depth=depth,
        stride_xm=x.stride(0),
        stride_wn=weight.stride(0),
        stride_wk=strides[0],
        stride_sn=strides[1],
        stride_sk=strides[2],
        stride_om=out.stride(0),
        WEIGHT_FORMAT=weight_format,
        SCALE_N=block[0],
        SCALE_K=block[1],
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        UPCAST=triton_interpreting(),
        PRECISION=dot_precision(x.dtype),
        DOT_SCALED=mxfp4_dot_scaled(x.dtype) if weight_format == "mxfp4" else None,
        num_warps=tiles.num_warps,
    )
    return out
