"""Partial NeoX rotary embedding with a precomputed cos/sin table shared by all attention layers."""

from __future__ import annotations

import torch
from torch import nn

from sglang_lite.kernels import apply_rotary


class RotaryEmbedding(nn.Module):
    """``mrope_section``: a VL checkpoint's M-RoPE sections (temporal, height, width frequencies), for the
    positions [3, T] of a prompt with images (``forward``'s ``mrope_positions``)."""

    def __init__(
        self,
        rotary_dim: int,
        max_position: int,
        theta: float,
        mrope_section: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.mrope_section = mrope_section
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
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        mrope_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if mrope_positions is None:
            return apply_rotary(q, k, positions, self.cos_sin_cache, self.rotary_dim)
        table = self.mrope_table(mrope_positions)
        rows = torch.arange(table.shape[0], device=table.device)
        return apply_rotary(q, k, rows, table, self.rotary_dim)

    def mrope_table(self, positions: torch.Tensor) -> torch.Tensor:
        """[T, rotary_dim] cos | sin rows for M-RoPE positions [3, T], interleaved as Qwen3.5 recomposes them:
        frequency i takes the height position where i % 3 == 1 (among the first 3 * sections[1]), the width
        position where i % 3 == 2 (among the first 3 * sections[2]), the temporal one elsewhere. A text token's
        three positions are equal, and its row is the 1-D table's."""
        half = self.rotary_dim // 2
        assert self.mrope_section is not None, (
            "M-RoPE positions need the checkpoint's mrope_section"
        )
        index = torch.arange(half, device=positions.device)
        component = torch.zeros(half, dtype=torch.int64, device=positions.device)
        for axis in (1, 2):
            component[(index % 3 == axis) & (index < 3 * self.mrope_section[axis])] = axis
        chosen = positions[component].t()
        table = self.cos_sin_cache
        return torch.cat([table[chosen, index], table[chosen, index + half]], dim=-1)
