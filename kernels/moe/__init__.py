"""Fused mixture of experts: softmax top-k routing and the grouped expert computation.

Each function runs the Triton kernel or the PyTorch reference per call (see ``kernels/dispatch.py``).
"""
from __future__ import annotations

import torch

from ..dispatch import use_triton
from . import naive, triton_moe


def topk_softmax(
    router_logits: torch.Tensor, top_k: int, renormalize: bool = True, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in fp32, keep the top k -> (weights fp32 [T, k], ids int32 [T, k])."""
    impl = triton_moe if use_triton(router_logits, backend) else naive
    return impl.topk_softmax(router_logits, top_k, renormalize)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """``sum_i w_i * down_e(silu(gate_e(x)) * up_e(x))`` over each token's selected experts (any k' columns)."""
    impl = triton_moe if use_triton(x, backend) else naive
    return impl.fused_moe(x, w13, w2, topk_weights, topk_ids)


__all__ = ["topk_softmax", "fused_moe"]
