"""Causal depthwise conv1d with SiLU over packed requests (prefill) and one token per request (decode).

Each public function runs the Triton kernel on a GPU and, on the CPU, the fused C++ kernel for float32 data (the
PyTorch reference for other dtypes); ``backend`` forces one
(see ``kernels/dispatch.py``).
"""

from __future__ import annotations

import torch

from .. import cpu
from ..dispatch import use_native, use_triton
from . import naive, triton_conv1d


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    activation: str | None = "silu",
    *,
    backend: str | None = None,
) -> torch.Tensor:
    if use_native(x, conv_states, backend=backend):
        return cpu.causal_conv1d_fn(x, weight, conv_states, state_indices, cu_seqlens, activation)
    impl = (
        triton_conv1d.causal_conv1d_fn_triton if use_triton(x, backend) else naive.causal_conv1d_fn
    )
    return impl(x, weight, conv_states, state_indices, cu_seqlens, activation)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
    *,
    backend: str | None = None,
) -> torch.Tensor:
    if use_native(x, conv_states, backend=backend):
        return cpu.causal_conv1d_update(x, weight, conv_states, state_indices, activation)
    impl = (
        triton_conv1d.causal_conv1d_update_triton
        if use_triton(x, backend)
        else naive.causal_conv1d_update
    )
    return impl(x, weight, conv_states, state_indices, activation)


__all__ = ["causal_conv1d_fn", "causal_conv1d_update"]
