"""Partial NeoX rotary embedding.

Each call runs the Triton kernel or the PyTorch reference (see ``kernels/dispatch.py``).
"""

from __future__ import annotations

import torch

from .. import cpu
from ..dispatch import as_decode_blocks, use_triton
from . import naive, triton_rotary


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, hd], k [T, KV, hd], positions [T] -> rotated copies of q and k (inputs are left untouched)."""
    if backend is None and as_decode_blocks(q, k, cos_sin_cache):
        return (
            cpu.rotary_rows(q, positions, cos_sin_cache, rotary_dim),
            cpu.rotary_rows(k, positions, cos_sin_cache, rotary_dim),
        )
    impl = triton_rotary if use_triton(q, backend) else naive
    return impl.apply_rotary(q, k, positions, cos_sin_cache, rotary_dim)


__all__ = ["apply_rotary"]
