"""Partial NeoX rotary embedding with a precomputed cos/sin table shared by all attention layers."""

from __future__ import annotations

import torch
from torch import nn

from sglang_lite.kernels import apply_rotary


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, max_position: int, theta: float) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
        )
        freqs = torch.arange(max_position, dtype=torch.float32).unsqueeze(1) * inv_freq
        self.register_buffer(
            "cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False
        )

    def _apply(self, fn, recurse: bool = True):
        # model.to(bfloat16) must move the table but not round it: angles at large positions would shift.
        table = self.cos_sin_cache
        super()._apply(fn, recurse)
        self.cos_sin_cache = table.to(self.cos_sin_cache.device)
        return self

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q, k, positions, self.cos_sin_cache, self.rotary_dim)
