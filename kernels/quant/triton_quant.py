"""Triton block FP8: per-token-group activation quantization and the W8A8 block-FP8 GEMM (as SGLang's
``per_token_group_quant_fp8`` and ``w8a8_block_fp8_matmul``).

The GEMM walks K one weight block (``BLOCK_K`` = the block's K size = the activation group) at a time: one FP8 x FP8
dot per tile, scaled in fp32 by the row's group scale and the column's weight-block scale, summed in fp32.
No host reads: the launches can be captured in a CUDA graph. Batch invariant with the switch: activation scales
per row, K in order, and the GEMM's tile fixed at every row count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import batch_invariant
from ..dispatch import triton_interpreting
from ..triton_utils import interpreted_dot
from .naive import MIN_AMAX, fp8_max


@triton.jit
def _per_token_group_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    num_cols,
    stride_x,
    stride_q,
    stride_s,
    max_value,
    min_amax,
    GROUP: tl.constexpr,
):
    row, group = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    ok = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), min_amax) / max_value
    q = tl.clamp(x / scale, -max_value, max_value)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_s + group, scale)


def per_token_group_quant(
    x: torch.Tensor, group: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (x_q [M, K] in ``dtype``, x_s float32 [M, ceil(K / group)])."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with contiguous rows, got shape {tuple(x.shape)}")
    if group < 16 or group & (group - 1):
        raise ValueError(f"group must be a power of two >= 16, got {group}")
    num_rows, num_cols = x.shape
    q = torch.empty(num_rows, num_cols, dtype=dtype, device=x.device)
    s = torch.empty(num_rows, triton.cdiv(num_cols, group), dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return q, s
    # Triton's interpreter rounds some values into the wrong binade (-124.9 -> -64 in e4m3fn): there the kernel
    # writes the scaled values in fp32 and torch rounds them to FP8
    staged = (
        torch.empty(q.shape, dtype=torch.float32, device=x.device) if triton_interpreting() else q
    )
    _per_token_group_quant_kernel[(num_rows, s.shape[1])](
        x_ptr=x,
        q_ptr=staged,
        s_ptr=s,
        num_cols=num_cols,
        stride_x=x.stride(0),
        stride_q=staged.stride(0),
        stride_s=s.stride(0),
        max_value=fp8_max(dtype),
        min_amax=MIN_AMAX,
        GROUP=group,
    )
    return (q.copy_(staged) if staged is not q else q), s


@triton.jit
def _w8a8_block_fp8_matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    a_s_ptr,
    b_s_ptr,
    num_rows,
    num_cols,
    depth,
    stride_am,
    stride_bn,
    stride_cm,
    stride_asm,
    stride_bsn,
    SCALE_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < num_rows, cols < num_cols
    a_rows = a_ptr + rows[:, None].to(tl.int64) * stride_am
    b_cols = b_ptr + cols[None, :].to(tl.int64) * stride_bn
    a_scales = a_s_ptr + rows.to(tl.int64) * stride_asm
    b_scales = b_s_ptr + (cols // SCALE_N) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(depth, BLOCK_K)):
        ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < depth
        a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        a_s = tl.load(a_scales + kb, mask=row_ok, other=0.0)
        b_s = tl.load(b_scales + kb, mask=col_ok, other=0.0)
        if UPCAST:  # the interpreter multiplies FP8 tiles as raw bits
            partial = interpreted_dot(a, b)
        else:
            partial = tl.dot(a, b)
        acc += partial * a_s[:, None] * b_s[None, :]
    tl.store(
        c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def w8a8_block_fp8_matmul(
    x_q: torch.Tensor,
    x_s: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``dequant(x_q, x_s) @ dequant(w, w_scale)^T``: x_q [M, K] FP8 with group scales x_s [M, ceil(K / bk)],
    w [N, K] FP8 with block scales w_scale [ceil(N / bn), ceil(K / bk)] -> [M, N] in ``out_dtype``."""
    num_rows, depth = x_q.shape
    num_cols = w.shape[0]
    bn, bk = block
    if w.shape[1] != depth or w.stride(1) != 1 or x_q.stride(1) != 1:
        raise ValueError(f"w must be [N, K={depth}] with contiguous rows, got {tuple(w.shape)}")
    if tuple(w_scale.shape) != (triton.cdiv(num_cols, bn), triton.cdiv(depth, bk)):
        raise ValueError(
            f"w_scale must be [{triton.cdiv(num_cols, bn)}, {triton.cdiv(depth, bk)}] for w "
            f"{tuple(w.shape)} in {bn}x{bk} blocks, got {tuple(w_scale.shape)}"
        )
    if tuple(x_s.shape) != (num_rows, triton.cdiv(depth, bk)):
        raise ValueError(
            f"x_s must be [{num_rows}, {triton.cdiv(depth, bk)}], got {tuple(x_s.shape)}"
        )
    out = torch.empty(num_rows, num_cols, dtype=out_dtype, device=x_q.device)
    if num_rows == 0:
        return out
    # a decode batch's few rows take a 16-row tile; under batch invariance every row count takes the 64-row one
    # (a different tile is a different dot instruction, and FP8 ones accumulate with limited precision)
    block_m = 16 if num_rows <= 16 and not batch_invariant.enabled() else 64
    block_n = 64
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(num_cols, block_n))
    _w8a8_block_fp8_matmul_kernel[grid](
        a_ptr=x_q,
        b_ptr=w,
        c_ptr=out,
        a_s_ptr=x_s,
        b_s_ptr=w_scale,
        num_rows=num_rows,
        num_cols=num_cols,
        depth=depth,
        stride_am=x_q.stride(0),
        stride_bn=w.stride(0),
        stride_cm=out.stride(0),
        stride_asm=x_s.stride(0),
        stride_bsn=w_scale.stride(0),
        SCALE_N=bn,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=bk,
        UPCAST=triton_interpreting(),
    )
    return out
