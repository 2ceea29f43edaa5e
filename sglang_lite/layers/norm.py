"""Normalisation layers; the math lives in sglang_lite.kernels.norms."""

from __future__ import annotations

import torch
from torch import nn

from sglang_lite.kernels import gated_rmsnorm, gemma_rmsnorm


class GemmaRMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * (1 + w)``, weight initialised to zeros; optionally fused with a residual add."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return gemma_rmsnorm(x, self.weight, self.eps, residual)


class GatedRMSNorm(nn.Module):
    """Per-head ``w * rmsnorm(o) * silu(z)``, weight initialised to ones."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rmsnorm(o, z, self.weight, self.eps)
