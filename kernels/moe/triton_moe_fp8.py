"""Triton fused MoE over block-FP8 experts: the two grouped GEMMs of ``triton_moe`` with FP8 tiles.

x is quantized per token group first, and so is the activation between the two GEMMs (per (token, expert) row),
as SGLang's FP8 fused MoE does; each K step multiplies one weight block and scales the fp32 partial sums by the
row's group scale and the column's block scale. Routing and the alignment by expert are ``triton_moe``'s; no
host reads (graph-capturable). Batch invariant as ``triton_moe``: constant tiles (K slices of one weight block),
K in order, per-row activation scales, the switch's in-order sum of a token's rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import triton_interpreting
from ..quant.triton_quant import per_token_group_quant
from .triton_moe import BLOCK_M, _check_moe_args, align_by_expert, sum_slots


@triton.jit
def _scaled_dot(a, b, a_s, b_s, acc, UPCAST: tl.constexpr):
    """``acc + (a @ b) * a_s[:, None] * b_s[None, :]`` in fp32 (``UPCAST``: the interpreter's FP8 as fp32)."""
    if UPCAST:
        partial = tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        partial = tl.dot(a, b)
    return acc + partial * a_s[:, None] * b_s[None, :]


@triton.jit
def _gate_up_silu_fp8_kernel(
    x_ptr,
    x_s_ptr,
    w13_ptr,
    w13_s_ptr,
    act_ptr,
    sorted_rows_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_rows,
    hidden,
    inter,
    stride_xt,
    stride_xst,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_at,
    TOP_K: tl.constexpr,
    SCALE_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0 or pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_rows
    tokens = rows // TOP_K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w_base = w13_ptr + expert.to(tl.int64) * stride_we
    s_base = w13_s_ptr + expert.to(tl.int64) * stride_wse
    gate_scales, up_scales = (
        s_base + (cols // SCALE_N) * stride_wsn,
        s_base + ((cols + inter) // SCALE_N) * stride_wsn,
    )
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(hidden, BLOCK_K)):
        ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        x = tl.load(
            x_ptr + tokens[:, None] * stride_xt + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        x_s = tl.load(x_s_ptr + tokens * stride_xst + kb, mask=row_ok, other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(
            w_base + (cols[None, :] + inter) * stride_wn + ks[:, None], mask=w_mask, other=0.0
        )
        acc_gate = _scaled_dot(
            x, w_gate, x_s, tl.load(gate_scales + kb, mask=col_ok, other=0.0), acc_gate, UPCAST
        )
        acc_up = _scaled_dot(
            x, w_up, x_s, tl.load(up_scales + kb, mask=col_ok, other=0.0), acc_up, UPCAST
        )
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(
        act_ptr + rows[:, None] * stride_at + cols[None, :],
        act.to(act_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _down_weighted_fp8_kernel(
    act_ptr,
    act_s_ptr,
    w2_ptr,
    w2_s_ptr,
    weights_ptr,
    out_ptr,
    sorted_rows_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_rows,
    hidden,
    inter,
    stride_at,
    stride_ast,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_ot,
    SCALE_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0 or pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_rows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_base = w2_ptr + expert.to(tl.int64) * stride_we
    w_scales = w2_s_ptr + expert.to(tl.int64) * stride_wse + (cols // SCALE_N) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(inter, BLOCK_K)):
        ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(
            act_ptr + rows[:, None] * stride_at + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        a_s = tl.load(act_s_ptr + rows * stride_ast + kb, mask=row_ok, other=0.0)
        w = tl.load(
            w_base + cols[None, :] * stride_wn + ks[:, None],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc = _scaled_dot(a, w, a_s, tl.load(w_scales + kb, mask=col_ok, other=0.0), acc, UPCAST)
    acc = acc * tl.load(weights_ptr + rows, mask=row_ok, other=0.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + cols[None, :],
        acc,
        mask=row_ok[:, None] & col_ok[None, :],
    )


def _as_dtype(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_strided(w.shape, w.stride(), dtype=dtype, device="meta")


def _check_scales(name: str, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
    want = (w.shape[0], triton.cdiv(w.shape[1], block[0]), triton.cdiv(w.shape[2], block[1]))
    if tuple(scale.shape) != want or scale.dtype != torch.float32:
        raise ValueError(
            f"{name} must be float32 {list(want)} for {tuple(w.shape)} in {block[0]}x{block[1]} "
            f"blocks, got {scale.dtype} {tuple(scale.shape)}"
        )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    block: tuple[int, int],
) -> torch.Tensor:
    """``sum_i w_i * down_e(silu(gate_e(x)) * up_e(x))`` with FP8 experts: x [T, H] (float dtype), w13 [E, 2I, H]
    and w2 [E, H, I] FP8 with float32 block scales [E, ceil(2I / bn), ceil(H / bk)] and [E, ceil(H / bn),
    ceil(I / bk)]; topk [T, k']. Output in x's dtype."""
    # the plain kernels' checks, on views of the weights' shapes and strides in x's dtype (FP8 data is 1 byte)
    _check_moe_args(x, _as_dtype(w13, x.dtype), _as_dtype(w2, x.dtype), topk_weights, topk_ids)
    _check_scales("w13_scale", w13, w13_scale, block)
    _check_scales("w2_scale", w2, w2_scale, block)
    num_tokens, top_k = topk_ids.shape
    num_experts = w2.shape[0]
    hidden, inter = w2.shape[1:]
    num_rows = num_tokens * top_k
    blocks = align_by_expert(topk_ids, num_experts, BLOCK_M)
    x_q, x_s = per_token_group_quant(x, block[1], w13.dtype)
    act = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    rows_out = torch.empty(num_rows, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    block_n, block_k = 64, block[1]
    _gate_up_silu_fp8_kernel[(blocks.block_expert.numel(), triton.cdiv(inter, block_n))](
        x_ptr=x_q,
        x_s_ptr=x_s,
        w13_ptr=w13,
        w13_s_ptr=w13_scale,
        act_ptr=act,
        sorted_rows_ptr=blocks.sorted_rows,
        block_expert_ptr=blocks.block_expert,
        num_padded_ptr=blocks.num_padded,
        num_rows=num_rows,
        hidden=hidden,
        inter=inter,
        stride_xt=x_q.stride(0),
        stride_xst=x_s.stride(0),
        stride_we=w13.stride(0),
        stride_wn=w13.stride(1),
        stride_wse=w13_scale.stride(0),
        stride_wsn=w13_scale.stride(1),
        stride_at=act.stride(0),
        TOP_K=top_k,
        SCALE_N=block[0],
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST=triton_interpreting(),
    )
    act_q, act_s = per_token_group_quant(act, block[1], w2.dtype)
    _down_weighted_fp8_kernel[(blocks.block_expert.numel(), triton.cdiv(hidden, block_n))](
        act_ptr=act_q,
        act_s_ptr=act_s,
        w2_ptr=w2,
        w2_s_ptr=w2_scale,
        weights_ptr=weights,
        out_ptr=rows_out,
        sorted_rows_ptr=blocks.sorted_rows,
        block_expert_ptr=blocks.block_expert,
        num_padded_ptr=blocks.num_padded,
        num_rows=num_rows,
        hidden=hidden,
        inter=inter,
        stride_at=act_q.stride(0),
        stride_ast=act_s.stride(0),
        stride_we=w2.stride(0),
        stride_wn=w2.stride(1),
        stride_wse=w2_scale.stride(0),
        stride_wsn=w2_scale.stride(1),
        stride_ot=rows_out.stride(0),
        SCALE_N=block[0],
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST=triton_interpreting(),
    )
    return sum_slots(rows_out.view(num_tokens, top_k, hidden)).to(x.dtype)
