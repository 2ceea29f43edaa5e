"""RMSNorm family: Gemma RMSNorm (optionally with residual add), fused q/k Gemma RMSNorm, gated RMSNorm.

Each public function runs the Triton kernel on a GPU and, on the CPU, the fused C++ kernel for float32 data or the
PyTorch reference; ``backend`` forces one
(see ``kernels/dispatch.py``).
"""

from __future__ import annotations

import torch

from .. import cpu
from ..dispatch import use_native, use_triton
from . import naive, triton_norms


def gemma_rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if use_native(x, *([] if residual is None else [residual]), backend=backend):
        return cpu.gemma_rmsnorm(x, weight, eps, residual)
    impl = triton_norms.gemma_rmsnorm_triton if use_triton(x, backend) else naive.gemma_rmsnorm
    return impl(x, weight, eps, residual)


def fused_qk_gemma_rmsnorm(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_native(q, k, backend=backend):
        return cpu.fused_qk_gemma_rmsnorm(q, k, q_weight, k_weight, eps, head_dim)
    impl = (
        triton_norms.fused_qk_gemma_rmsnorm_triton
        if use_triton(q, backend)
        else naive.fused_qk_gemma_rmsnorm
    )
    return impl(q, k, q_weight, k_weight, eps, head_dim)


def gated_rmsnorm(
    o: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    if use_native(o, backend=backend):
        return cpu.gated_rmsnorm(o, z, weight, eps)
    impl = triton_norms.gated_rmsnorm_triton if use_triton(o, backend) else naive.gated_rmsnorm
    return impl(o, z, weight, eps)


__all__ = ["gemma_rmsnorm", "fused_qk_gemma_rmsnorm", "gated_rmsnorm"]
