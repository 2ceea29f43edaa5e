"""Triton fused MoE: softmax top-k routing, token alignment by expert, and two grouped GEMM kernels whose expert
weight format is a constexpr (``WEIGHT_FORMAT``):

- ``"plain"``: float experts in x's dtype;
- ``"fp8"``: block-FP8 experts with float32 block scales. x is quantized per token group first, and so is the
  activation between the two GEMMs (per (token, expert) row), as SGLang's FP8 fused MoE does; each K step
  multiplies one weight block and scales the fp32 partial sums by the row's group scale and the block's scale;
- ``"mxfp4"``: e2m1 codes two a byte with e8m0 scales per 32 columns (``kernels/quant/mxfp4.py``), weight-only:
  each K step dequantizes its tile in registers, or hands it to ``tl.dot_scaled`` on gfx950
  (``triton_linear.mxfp4_dot``).

The grouped GEMMs walk a list of token rows sorted by expert and padded so that each block of BLOCK_M rows
belongs to one expert (``align_by_expert``). Kernel 1 computes ``silu(x W_gate^T) * (x W_up^T)`` for a block of
rows and a block of intermediate columns, reading the gate and up rows of w13 side by side (gate_up fusion).
Kernel 2 computes ``w * (act W_down^T)`` per (token, selected expert) row; the launcher sums the k' rows of a
token in fp32. topk_ids may hold any expert id below w13.shape[0], so a shared expert appended as expert E
(with its own per-token weight) runs in the same pass as the routed ones. No host reads (graph-capturable).

Batch invariant as they stand: the tiles (BLOCK_M rows of one expert, 64 columns, K slices of the format's depth)
are constants and each program walks K in order into one fp32 accumulator, so a row's sums never depend on the
token count or on which rows share its block (FP8 activation scales are per row); no atomics. Under the switch
only the final sum over a token's k' rows changes (``sum_slots``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import batch_invariant
from ..dispatch import dot_precision, triton_interpreting
from ..linear.triton_linear import mxfp4_dot, mxfp4_dot_scaled
from ..quant.triton_quant import per_token_group_quant
from ..triton_utils import interpreted_dot, row_dot_accumulate

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
def _scaled_dot(a, b, a_s, b_s, acc, UPCAST: tl.constexpr):
    """``acc + (a @ b) * a_s[:, None] * b_s[None, :]`` in fp32 (``UPCAST``: the interpreter's FP8 as fp32, through
    ``interpreted_dot``)."""
    if UPCAST:
        partial = interpreted_dot(a, b)
    else:
        partial = tl.dot(a, b)
    return acc + partial * a_s[:, None] * b_s[None, :]


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    a_s_ptr,
    w_ptr,
    w_s_ptr,
    weights_ptr,
    out_ptr,
    sorted_rows_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_rows,
    depth,
    num_cols,
    stride_a,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    GATE_UP: tl.constexpr,
    TOP_K: tl.constexpr,
    WEIGHT_FORMAT: tl.constexpr,
    SCALE_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_SCALED: tl.constexpr,
):
    """``GATE_UP``: kernel 1, ``silu(a W_gate^T) * (a W_up^T)`` with a's row shared by ``TOP_K`` (token, slot)
    rows; else kernel 2, ``weight * (a W^T)`` per (token, slot) row (``TOP_K`` 1). The result is [rows,
    num_cols], contiguous."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0 or pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_rows
    a_rows = rows // TOP_K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # kernel 1 reads w13's gate row c and up row c + I side by side: one product a step, split at the end
    if GATE_UP:
        n = tl.reshape(tl.join(cols, cols + num_cols), (2 * BLOCK_N,))
        n_ok = tl.reshape(tl.join(cols, cols), (2 * BLOCK_N,)) < num_cols
    else:
        n, n_ok = cols, cols < num_cols
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + n * stride_wn
    # FP8 scales come per block of SCALE_N rows, MXFP4 ones per row (SCALE_N 1)
    s_rows = w_s_ptr + expert.to(tl.int64) * stride_se + (n // SCALE_N) * stride_sn
    acc = tl.zeros([BLOCK_M, n.shape[0]], dtype=tl.float32)
    for kb in range(0, tl.cdiv(depth, BLOCK_K)):
        ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < depth
        a_mask = row_ok[:, None] & k_ok[None, :]
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :], mask=a_mask, other=0.0)
        if WEIGHT_FORMAT == "mxfp4":
            acc = mxfp4_dot(
                acc,
                a,
                w_rows,
                s_rows,
                n_ok,
                kb * BLOCK_K,
                depth,
                BLOCK_K,
                UPCAST,
                PRECISION,
                DOT_SCALED,
            )
        else:
            w = tl.load(
                w_rows[None, :] + ks[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0
            )
            if WEIGHT_FORMAT == "fp8":
                # a's group scales are [rows, ceil(depth / BLOCK_K)]
                a_s = tl.load(
                    a_s_ptr + a_rows * tl.cdiv(depth, BLOCK_K) + kb, mask=row_ok, other=0.0
                )
                w_s = tl.load(s_rows + kb, mask=n_ok, other=0.0)
                acc = _scaled_dot(a, w, a_s, w_s, acc, UPCAST)
            else:
                acc = row_dot_accumulate(a, w, acc, UPCAST, PRECISION)
    if GATE_UP:
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        out = gate * tl.sigmoid(gate) * up
    else:
        out = acc * tl.load(weights_ptr + rows, mask=row_ok, other=0.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * num_cols + cols[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (cols < num_cols)[None, :],
    )


class _Format(NamedTuple):
    """How the grouped GEMMs read one kind of experts: ``name`` is the kernels' WEIGHT_FORMAT, ``block_k`` the K
    of a step (64: two MXFP4 groups; FP8: one weight block), ``scale_n`` the weight rows of an FP8 scale block."""

    name: str
    block_k: int
    scale_n: int = 1


def _check_moe_args(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    packing: int = 1,
) -> None:
    """Shapes and strides; ``packing``: weight elements a stored element (MXFP4 holds two a byte)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, H] with contiguous rows, got shape {tuple(x.shape)}")
    num_experts, two_inter = w13.shape[:2]
    hidden = x.shape[1]
    packed = "" if packing == 1 else f" / {packing}"
    if w13.dim() != 3 or w13.shape[2] * packing != hidden or two_inter % 2 or w13.stride(2) != 1:
        raise ValueError(
            f"w13 must be [E, 2I, H{packed}] for H={hidden} with contiguous rows, got {tuple(w13.shape)}"
        )
    if (
        w2.dim() != 3
        or w2.shape[:2] != (num_experts, hidden)
        or w2.shape[2] * packing * 2 != two_inter
    ):
        raise ValueError(
            f"w2 must be [E={num_experts}, H={hidden}, I{packed}] for I={two_inter // 2}, got "
            f"{tuple(w2.shape)}"
        )
    if w2.stride(2) != 1:
        raise ValueError(f"w2 must have contiguous rows, got strides {w2.stride()}")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"topk_ids must be integer [T={x.shape[0]}, k], got {tuple(ids.shape)} {ids.dtype}"
        )
    if weights.shape != ids.shape:
        raise ValueError(
            f"topk_weights must have the shape of topk_ids {tuple(ids.shape)}, got {tuple(weights.shape)}"
        )


def _check_fp8_scales(
    name: str, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> None:
    want = (w.shape[0], triton.cdiv(w.shape[1], block[0]), triton.cdiv(w.shape[2], block[1]))
    if tuple(scale.shape) != want or scale.dtype != torch.float32 or scale.stride(2) != 1:
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
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``sum_i w_i * down_e(silu(gate_e(x)) * up_e(x))``; x [T, H], w13 [E, 2I, H], w2 [E, H, I] in x's dtype,
    topk [T, k']. Block-FP8 experts: w13 and w2 FP8 with float32 scales ``w13_scale`` [E, ceil(2I / bn),
    ceil(H / bk)] and ``w2_scale`` [E, ceil(H / bn), ceil(I / bk)] for ``block`` (bn, bk), the activations
    quantized per token group of bk columns. Output in x's dtype."""
    _check_moe_args(x, w13, w2, topk_weights, topk_ids)
    experts = (w13, w13_scale, w2, w2_scale)
    if w13_scale is not None:
        _check_fp8_scales("w13_scale", w13, w13_scale, block)
        _check_fp8_scales("w2_scale", w2, w2_scale, block)
        return _grouped_moe(x, experts, topk_weights, topk_ids, _Format("fp8", block[1], block[0]))
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(
            f"w13 ({w13.dtype}) and w2 ({w2.dtype}) must have the dtype of x ({x.dtype})"
        )
    return _grouped_moe(x, experts, topk_weights, topk_ids, _Format("plain", 64))


def fused_moe_mxfp4(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
) -> torch.Tensor:
    """``fused_moe`` with MXFP4 experts (weight-only, x is not quantized): x [T, H] (float32, bf16 or fp16),
    w13 uint8 [E, 2I, H / 2] and w2 uint8 [E, H, I / 2] (two e2m1 codes a byte, element 2j in the low nibble)
    with e8m0 scales ``w13_scale`` uint8 [E, 2I, ceil(H / 32)] and ``w2_scale`` uint8 [E, H, ceil(I / 32)], rows
    contiguous; topk [T, k']. Output in x's dtype."""
    _check_moe_args(x, w13, w2, topk_weights, topk_ids, packing=2)
    if w13_scale.stride(2) != 1 or w2_scale.stride(2) != 1:
        raise ValueError("MXFP4 scales must have contiguous rows")
    fmt = _Format("mxfp4", 64)
    return _grouped_moe(x, (w13, w13_scale, w2, w2_scale), topk_weights, topk_ids, fmt)


def _grouped_moe(
    x: torch.Tensor,
    experts: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    fmt: _Format,
) -> torch.Tensor:
    """The two grouped GEMMs over ``experts`` (w13, its scales, w2, its scales), checked by the callers."""
    w13, w13_scale, w2, w2_scale = experts
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden = w2.shape[:2]
    inter = w13.shape[1] // 2
    num_rows = num_tokens * top_k
    blocks = align_by_expert(topk_ids, num_experts, BLOCK_M)
    act = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    rows_out = torch.empty(num_rows, hidden, dtype=torch.float32, device=x.device)
    block_n = 64
    common = dict(
        weights_ptr=topk_weights.reshape(-1).float().contiguous(),
        sorted_rows_ptr=blocks.sorted_rows,
        block_expert_ptr=blocks.block_expert,
        num_padded_ptr=blocks.num_padded,
        num_rows=num_rows,
        WEIGHT_FORMAT=fmt.name,
        SCALE_N=fmt.scale_n,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=fmt.block_k,
        UPCAST=triton_interpreting(),
        PRECISION=dot_precision(x.dtype),
        DOT_SCALED=mxfp4_dot_scaled(x.dtype) if fmt.name == "mxfp4" else None,
    )
    num_blocks = blocks.block_expert.numel()
    _grouped_gemm_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        **_operands(x, w13, w13_scale, fmt),
        **_output(act, depth=hidden, gate_up=True, top_k=top_k),
        **common,
    )
    _grouped_gemm_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        **_operands(act, w2, w2_scale, fmt),
        **_output(rows_out, depth=inter, gate_up=False, top_k=1),
        **common,
    )
    return sum_slots(rows_out.view(num_tokens, top_k, hidden)).to(x.dtype)


def _operands(
    a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None, fmt: _Format
) -> dict[str, object]:
    """One GEMM's activation rows ``a`` (FP8 experts: quantized per group of ``block_k`` columns to their dtype)
    and experts ``w`` with their scales, as the kernel's arguments; an absent tensor's place holds one never read."""
    a_s = a
    if fmt.name == "fp8":
        a, a_s = per_token_group_quant(a, fmt.block_k, w.dtype)
    scale = w if w_scale is None else w_scale
    pointers = dict(a_ptr=a, a_s_ptr=a_s, w_ptr=w, w_s_ptr=scale)
    strides = dict(stride_a=a.stride(0), stride_we=w.stride(0), stride_wn=w.stride(1))
    return pointers | strides | dict(stride_se=scale.stride(0), stride_sn=scale.stride(1))


def _output(out: torch.Tensor, depth: int, gate_up: bool, top_k: int) -> dict[str, object]:
    """One GEMM's result rows ``out`` (their columns the kernel's), its K depth and which GEMM it is."""
    return dict(
        out_ptr=out,
        depth=depth,
        num_cols=out.shape[1],
        GATE_UP=gate_up,
        TOP_K=top_k,
    )


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
