"""Plain-PyTorch bias-free linear layer; also the CPU path for what the fused kernel does not take."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` for x [..., K] and weight [N, K] in either memory layout."""
    return F.linear(x, weight)
