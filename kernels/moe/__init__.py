"""Fused mixture of experts: softmax top-k routing and the grouped expert computation.

Each function runs the Triton kernel, the fused C++ CPU kernel (float32 experts) or the PyTorch reference per call
(see ``kernels/dispatch.py``).
"""

from __future__ import annotations

import torch

from .. import cpu
from ..dispatch import use_native, use_triton
from ..quant import mxfp4
from . import naive, triton_moe


def topk_softmax(
    router_logits: torch.Tensor, top_k: int, renormalize: bool = True, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in fp32, keep the top k -> (weights fp32 [T, k], ids int32 [T, k])."""
    impl = triton_moe if use_triton(router_logits, backend) else naive
    return impl.topk_softmax(router_logits, top_k, renormalize)


def moe_route(
    router_logits: torch.Tensor,
    shared_logits: torch.Tensor | None,
    top_k: int,
    renormalize: bool = True,
    shared_id: int = 0,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_softmax`` (weights fp32 [T, k], ids int32 [T, k]); with ``shared_logits`` [T, 1] one more column:
    the fused shared expert ``shared_id`` with weight sigmoid(shared logit). One fused call on the CPU."""
    if use_native(
        router_logits, *([] if shared_logits is None else [shared_logits]), backend=backend
    ):
        return cpu.moe_route(router_logits, shared_logits, top_k, renormalize, shared_id)
    if use_triton(router_logits, backend):
        routed = triton_moe.topk_softmax(router_logits, top_k, renormalize)
        return naive.append_shared_expert(*routed, shared_logits, shared_id)
    return naive.moe_route(router_logits, shared_logits, top_k, renormalize, shared_id)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
    weight_format: str | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``sum_i w_i * down_e(silu(gate_e(x)) * up_e(x))`` over each token's selected experts (any k' columns).

    Experts in another dtype than x's are widened to it (in registers by the CPU's C++ kernel). Block-FP8 experts:
    w13 [E, 2I, H] and w2 [E, H, I] in an FP8 dtype with float32 scales ``w13_scale`` [E, ceil(2I / bn),
    ceil(H / bk)] and ``w2_scale`` [E, ceil(H / bn), ceil(I / bk)] for ``block`` (bn, bk). On a GPU and in the
    reference, activations are quantized per token group of bk columns (see ``kernels/quant``); the CPU's C++ kernel
    keeps them float32 and dequantizes the weights in registers (the dequantized model's products).
    ``weight_format="mxfp4"``: w13 uint8 [E, 2I, H / 2] and w2 uint8 [E, H, I / 2] hold e2m1 codes two a byte,
    ``w13_scale`` uint8 [E, 2I, ceil(H / 32)] and ``w2_scale`` uint8 [E, H, ceil(I / 32)] their e8m0 scales
    (``kernels/quant/mxfp4.py``); weight-only, x is not quantized.
    """
    if weight_format == "mxfp4":
        return _fused_moe_mxfp4(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, backend)
    if weight_format is not None:
        raise ValueError(f"unknown weight_format {weight_format!r}; expected None or 'mxfp4'")
    native = use_native(x, backend=backend) and cpu.takes_moe(w13, block)
    if native and w13.dtype == w2.dtype:
        return cpu.fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block)
    if w13_scale is None and w13.dtype != x.dtype:
        w13, w2 = w13.to(x.dtype), w2.to(x.dtype)
    scaled = (w13_scale, w2_scale, block)
    if use_triton(x, backend):
        return triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids, *scaled)
    if w13_scale is not None:
        return naive.fused_moe_fp8(x, w13, w2, topk_weights, topk_ids, *scaled)
    return naive.fused_moe(x, w13, w2, topk_weights, topk_ids)


def _fused_moe_mxfp4(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    backend: str | None,
) -> torch.Tensor:
    hidden = mxfp4.check_shapes(w13, w13_scale, "w13")
    inter = mxfp4.check_shapes(w2, w2_scale, "w2")
    if x.shape[-1] != hidden or w13.shape[1] != 2 * inter or w2.shape[1] != hidden:
        raise ValueError(
            f"MXFP4 experts w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} (packed) do not fit x with "
            f"{x.shape[-1]} columns"
        )
    args = (x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    if cpu.takes_moe_mxfp4(x, w13) and use_native(x, backend=backend):
        return cpu.fused_moe_mxfp4(*args)
    if use_triton(x, backend):
        return triton_moe.fused_moe_mxfp4(*args)
    return naive.fused_moe_mxfp4(*args)


__all__ = ["topk_softmax", "moe_route", "fused_moe"]
