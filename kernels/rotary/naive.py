"""Plain-PyTorch partial NeoX rotary embedding (rotate_half on the first ``rotary_dim`` dims); also the CPU path.

``cos_sin_cache`` [max_position, rotary_dim] in fp32: the first rotary_dim/2 columns are cos, the rest sin.
"""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rot.float().chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([rotated, rest], dim=-1)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, hd], k [T, KV, hd], positions [T] -> rotated copies of q and k."""
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin, rotary_dim), _rotate(k, cos, sin, rotary_dim)
