"""Plain-PyTorch bias-free linear layer; also the CPU path for what the fused kernel does not take."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant.naive import dequantize_blocks


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``x @ W^T`` for x [..., K] and W [N, K] in either memory layout: ``weight`` widened to x's dtype, or an FP8
    ``weight`` times its ``weight_scale`` over ``block`` blocks (dequantized exactly, in float32)."""
    if weight_scale is not None:
        return F.linear(x, dequantize_blocks(weight, weight_scale, block, x.dtype))
    return F.linear(x, weight if weight.dtype == x.dtype else weight.to(x.dtype))
