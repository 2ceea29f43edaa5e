"""Gated delta rule: gating, chunked prefill over packed requests, recurrent decode.

Each public function runs the Triton kernel on a GPU and, on the CPU, the fused C++ kernel for float32 data (the
PyTorch reference for other dtypes); ``backend`` forces one
(see ``kernels/dispatch.py``). Under batch invariance the Triton prefill is the decode kernel's recurrence token
by token (``triton_gdn.recurrent_prefill_triton``), whatever the split of a prompt into chunks.
"""

from __future__ import annotations

import torch

from .. import batch_invariant, cpu
from ..dispatch import use_native, use_triton
from . import naive, triton_gdn


def fused_gdn_gating(
    A_log: torch.Tensor,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    b: torch.Tensor,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_native(a, backend=backend):
        return cpu.fused_gdn_gating(A_log, a, dt_bias, b)
    impl = triton_gdn.fused_gdn_gating_triton if use_triton(a, backend) else naive.fused_gdn_gating
    return impl(A_log, a, dt_bias, b)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    if use_native(q, k, v, ssm_states, backend=backend):
        return cpu.chunk_gated_delta_rule(
            q, k, v, g, beta, ssm_states, state_indices, cu_seqlens, scale, use_qk_l2norm
        )
    if not use_triton(q, backend):
        impl = naive.chunk_gated_delta_rule
    elif batch_invariant.enabled():
        impl = triton_gdn.recurrent_prefill_triton
    else:
        impl = triton_gdn.chunk_gated_delta_rule_triton
    return impl(
        q, k, v, g, beta, ssm_states, state_indices, cu_seqlens, scale, use_qk_l2norm, chunk_size
    )


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    if use_native(q, k, v, ssm_states, backend=backend):
        return cpu.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, ssm_states, state_indices, scale, use_qk_l2norm
        )
    triton_impl = triton_gdn.fused_recurrent_gated_delta_rule_triton
    impl = triton_impl if use_triton(q, backend) else naive.fused_recurrent_gated_delta_rule
    return impl(q, k, v, g, beta, ssm_states, state_indices, scale, use_qk_l2norm)


__all__ = ["fused_gdn_gating", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]
