"""Triton fused MoE: softmax top-k routing, token alignment by expert, and two grouped GEMM kernels.

The grouped GEMMs walk a list of token rows sorted by expert and padded so that each block of BLOCK_M rows
belongs to one expert (``align_by_expert``). Kernel 1 computes ``silu(x W_gate^T) * (x W_up^T)`` for a block of
rows and a block of intermediate columns, reading the gate and up rows of w13 side by side (gate_up fusion).
Kernel 2 computes ``w * (act W_down^T)`` per (token, selected expert) row; the launcher sums the k' rows of a
token in fp32. topk_ids may hold any expert id below w13.shape[0], so a shared expert appended as expert E
(with its own per-token weight) runs in the same pass as the routed ones.

Batch invariant as they stand: the tiles (BLOCK_M rows of one expert, 64 columns, 64-deep K slices) are constants
and each program walks K in order into one fp32 accumulator, so a row's sums never depend on the token count or
on which rows share its block; no atomics. Under the switch only the final sum over a token's k' rows changes
(``sum_slots``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import batch_invariant
from ..dispatch import dot_precision, triton_interpreting
from ..triton_utils import dot_accumulate

# Rows per block of the grouped GEMM; every expert's row list is padded to a multiple of it.
BLOCK_M = 16


@triton.jit
def _topk_softmax_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    num_experts,
    stride_logits,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < num_tokens
    mask = row_ok[:, None] & (cols[None, :] < num_experts)
    logits = tl.load(
        logits_ptr + rows[:, None] * stride_logits + cols[None, :], mask=mask, other=-float("inf")
    )
    # rows past the end are all -inf; zero them so the softmax below stays finite (they are never stored)
    logits = tl.where(row_ok[:, None], logits.to(tl.float32), 0.0)
    probs = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = probs / tl.sum(probs, axis=1)[:, None]
    probs = tl.where(mask, probs, -1.0)  # padding columns can never be picked
    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    top_id = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        # lowest expert id among equal maxima, as a stable choice
        best_id = tl.min(tl.where(probs == best[:, None], cols[None, :], BLOCK_E), axis=1)
        top_w = tl.where(slots[None, :] == i, best[:, None], top_w)
        top_id = tl.where(slots[None, :] == i, best_id[:, None], top_id)
        probs = tl.where(cols[None, :] == best_id[:, None], -1.0, probs)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
    out_mask = row_ok[:, None] & (slots[None, :] < TOP_K)
    out_offs = rows[:, None] * TOP_K + slots[None, :]
    tl.store(weights_ptr + out_offs, top_w, mask=out_mask)
    tl.store(ids_ptr + out_offs, top_id, mask=out_mask)


def topk_softmax(
    router_logits: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights fp32 [T, top_k], ids int32 [T, top_k])."""
    if router_logits.dim() != 2 or router_logits.stride(1) != 1:
        raise ValueError(
            f"router_logits must be 2-D with contiguous rows, got shape {tuple(router_logits.shape)}"
        )
    num_tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(
            f"top_k must be in [1, {num_experts}] (router_logits has {num_experts} experts), got {top_k}"
        )
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    block_t = 16
    _topk_softmax_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits_ptr=router_logits,
        weights_ptr=weights,
        ids_ptr=ids,
        num_tokens=num_tokens,
        num_experts=num_experts,
        stride_logits=router_logits.stride(0),
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        BLOCK_T=block_t,
        BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_K=triton.next_power_of_2(top_k),
    )
    return weights, ids


class ExpertBlocks(NamedTuple):
    """The flat (token, slot) rows grouped by expert into blocks of ``block_m`` rows (see ``align_by_expert``)."""

    sorted_rows: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Sort the flat (token, slot) rows by expert, padding each expert's list to a multiple of ``block_m``.

    Returns ``sorted_rows`` (flat row ids, ``topk_ids.numel()`` marks padding), ``block_expert`` (expert id per
    block, -1 for blocks past the end) and ``num_padded`` (a 1-element tensor: rows in use). Sizes are upper
    bounds known without reading device data, so no host sync happens here.
    """
    flat = topk_ids.reshape(-1).long()
    num_rows = flat.numel()
    # scatter_add, not bincount: bincount reads its input's max back to the host, which CUDA graphs forbid
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert_sorted = flat[order]
    rank = torch.arange(num_rows, device=flat.device) - (counts.cumsum(0) - counts)[expert_sorted]
    capacity = num_rows + num_experts * (block_m - 1)
    sorted_rows = torch.full((capacity,), num_rows, dtype=torch.int32, device=flat.device)
    sorted_rows[(padded_end - padded)[expert_sorted] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.bucketize(block_starts, padded_end, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return ExpertBlocks(sorted_rows, block_expert, padded_end[-1:].to(torch.int32))


@triton.jit
def _gate_up_silu_kernel(
    x_ptr,
    w13_ptr,
    act_ptr,
    sorted_rows_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_rows,
    hidden,
    inter,
    stride_xt,
    stride_we,
    stride_wn,
    stride_at,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
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
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        x = tl.load(
            x_ptr + tokens[:, None] * stride_xt + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(
            w_base + (cols[None, :] + inter) * stride_wn + ks[:, None], mask=w_mask, other=0.0
        )
        acc_gate = dot_accumulate(x, w_gate, acc_gate, UPCAST, PRECISION)
        acc_up = dot_accumulate(x, w_up, acc_up, UPCAST, PRECISION)
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(
        act_ptr + rows[:, None] * stride_at + cols[None, :],
        act.to(act_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _down_weighted_kernel(
    act_ptr,
    w2_ptr,
    weights_ptr,
    out_ptr,
    sorted_rows_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_rows,
    hidden,
    inter,
    stride_at,
    stride_we,
    stride_wn,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(
            act_ptr + rows[:, None] * stride_at + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_base + cols[None, :] * stride_wn + ks[:, None],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc = dot_accumulate(a, w, acc, UPCAST, PRECISION)
    acc = acc * tl.load(weights_ptr + rows, mask=row_ok, other=0.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + cols[None, :],
        acc,
        mask=row_ok[:, None] & col_ok[None, :],
    )


def _check_moe_args(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
):
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, H] with contiguous rows, got shape {tuple(x.shape)}")
    num_experts = w13.shape[0]
    two_inter, hidden = w13.shape[1:]
    if hidden != x.shape[1] or two_inter % 2 or w13.stride(2) != 1:
        raise ValueError(
            f"w13 must be [E, 2I, H={x.shape[1]}] with contiguous rows, got {tuple(w13.shape)}"
        )
    if tuple(w2.shape) != (num_experts, hidden, two_inter // 2) or w2.stride(2) != 1:
        raise ValueError(
            f"w2 must be [E={num_experts}, H={hidden}, I={two_inter // 2}], got {tuple(w2.shape)}"
        )
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(
            f"w13 ({w13.dtype}) and w2 ({w2.dtype}) must have the dtype of x ({x.dtype})"
        )
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"topk_ids must be integer [T={x.shape[0]}, k], got {tuple(ids.shape)} {ids.dtype}"
        )
    if weights.shape != ids.shape:
        raise ValueError(
            f"topk_weights must have the shape of topk_ids {tuple(ids.shape)}, got {tuple(weights.shape)}"
        )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``sum_i w_i * down_e(silu(gate_e(x)) * up_e(x))``; x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk [T, k']."""
    _check_moe_args(x, w13, w2, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    num_experts = w2.shape[0]
    hidden, inter = w2.shape[1:]
    num_rows = num_tokens * top_k
    blocks = align_by_expert(topk_ids, num_experts, BLOCK_M)
    act = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    rows_out = torch.empty(num_rows, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    block_n, block_k = 64, 64
    _gate_up_silu_kernel[(blocks.block_expert.numel(), triton.cdiv(inter, block_n))](
        x_ptr=x,
        w13_ptr=w13,
        act_ptr=act,
        sorted_rows_ptr=blocks.sorted_rows,
        block_expert_ptr=blocks.block_expert,
        num_padded_ptr=blocks.num_padded,
        num_rows=num_rows,
        hidden=hidden,
        inter=inter,
        stride_xt=x.stride(0),
        stride_we=w13.stride(0),
        stride_wn=w13.stride(1),
        stride_at=act.stride(0),
        TOP_K=top_k,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST=triton_interpreting(),
        PRECISION=dot_precision(x.dtype),
    )
    _down_weighted_kernel[(blocks.block_expert.numel(), triton.cdiv(hidden, block_n))](
        act_ptr=act,
        w2_ptr=w2,
        weights_ptr=weights,
        out_ptr=rows_out,
        sorted_rows_ptr=blocks.sorted_rows,
        block_expert_ptr=blocks.block_expert,
        num_padded_ptr=blocks.num_padded,
        num_rows=num_rows,
        hidden=hidden,
        inter=inter,
        stride_at=act.stride(0),
        stride_we=w2.stride(0),
        stride_wn=w2.stride(1),
        stride_ot=rows_out.stride(0),
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST=triton_interpreting(),
        PRECISION=dot_precision(x.dtype),
    )
    return sum_slots(rows_out.view(num_tokens, top_k, hidden)).to(x.dtype)


def sum_slots(rows: torch.Tensor) -> torch.Tensor:
    """[T, k', H] fp32 -> [T, H]: each token's k' weighted expert rows summed in fp32 (no atomics). Under batch
    invariance slot after slot, an order fixed per element, where torch's reduction picks its blocking (and with
    it the order of the k' terms) from the whole tensor's sizes by rules it does not promise to keep."""
    if not batch_invariant.enabled():
        return rows.sum(1)
    total = rows[:, 0].clone()
    for slot in range(1, rows.shape[1]):
        total += rows[:, slot]
    return total
