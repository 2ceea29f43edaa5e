"""Plain-PyTorch references for the RMSNorm family; also the CPU path. Math in fp32, outputs in the input dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def gemma_rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x * rsqrt(mean(x^2) + eps) * (1 + w)``; with ``residual``, normalises ``x + residual`` and returns it too."""
    if residual is not None:
        x = x + residual
    y = (_rms(x, eps) * (1.0 + weight.float())).to(x.dtype)
    return y if residual is None else (y, x)


def fused_qk_gemma_rmsnorm(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma RMSNorm of every head_dim-sized row of q and of k; new tensors shaped like the inputs."""
    q_out = gemma_rmsnorm(q.reshape(-1, head_dim), q_weight, eps).reshape(q.shape)
    k_out = gemma_rmsnorm(k.reshape(-1, head_dim), k_weight, eps).reshape(k.shape)
    return q_out, k_out


def gated_rmsnorm(
    o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``w * rmsnorm(o) * silu(z)`` over the last dim (one value head), plain weight (initialised to ones)."""
    return (_rms(o, eps) * weight.float() * F.silu(z.float())).to(o.dtype)
