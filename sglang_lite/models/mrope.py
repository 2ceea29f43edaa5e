"""Qwen3.5's multimodal rotary positions (M-RoPE): three a token (temporal, height, width).

A text token has its index (shifted past earlier images) three times; an image token its place in
its image's merged grid, offset by where the image starts. Each rotary frequency then takes one of
the three positions, in the interleaved layout Qwen3.5 uses (``layers/rotary.py``'s ``mrope_table``).
Equal to transformers' ``get_rope_index`` for images (no video). ``apply_rotary`` rotates by cos and
sin rows (the vision tower's rotary)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch


def mrope_positions(
    input_ids: list[int],
    image_grid_thw: list[tuple[int, int, int]],
    image_token_id: int,
    spatial_merge_size: int,
) -> tuple[torch.Tensor, int]:
    """The positions [3, T] (int64) of one sequence and its delta (``max + 1 - T``: a token after
    the sequence at index i has position i + delta on all three axes).

    A run of ``image_token_id`` holds the next images of ``image_grid_thw`` in order, each
    ``t * h * w // spatial_merge_size**2`` tokens (one run per image where images are separated by
    other tokens, as a chat template does)."""
    if not input_ids:
        raise ValueError("mrope_positions: input_ids is empty")
    grids = iter(image_grid_thw)
    parts = []
    start = 0
    for begin, end, is_image in _runs(np.asarray(input_ids) == image_token_id):
        if is_image:
            part, start = _image_run_positions(end - begin, grids, start, spatial_merge_size)
        else:
            part = torch.arange(start, start + end - begin, dtype=torch.int64).expand(3, -1)
            start += end - begin
        parts.append(part)
    left = len(list(grids))
    if left:
        raise ValueError(f"mrope_positions: {left} image grid(s) have no image tokens in input_ids")
    positions = torch.cat(parts, dim=1)
    return positions, int(positions.max()) + 1 - len(input_ids)


def _runs(mask: np.ndarray) -> list[tuple[int, int, bool]]:
    """(begin, end, value) of each maximal run of equal values in a boolean mask."""
    changes = np.flatnonzero(mask[1:] != mask[:-1]) + 1
    bounds = [0, *changes.tolist(), len(mask)]
    return [(b, e, bool(mask[b])) for b, e in zip(bounds[:-1], bounds[1:])]


def _image_run_positions(
    length: int, grids: Iterator[tuple[int, int, int]], start: int, merge: int
) -> tuple[torch.Tensor, int]:
    """Positions of a run of ``length`` image tokens holding the next images of ``grids``, and the
    next start."""
    parts = []
    while length > 0:
        grid = next(grids, None)
        if grid is None:
            raise ValueError(
                "mrope_positions: more image tokens in input_ids than image_grid_thw holds"
            )
        part = image_positions(grid, start, merge)
        if not 0 < part.shape[1] <= length:
            raise ValueError(
                f"mrope_positions: image grid {tuple(grid)} needs {part.shape[1]} image tokens, "
                f"input_ids has a run of {length}"
            )
        parts.append(part)
        length -= part.shape[1]
        # transformers advances by the larger side of the merged grid, whatever t is
        start += max(grid[1], grid[2]) // merge
    return torch.cat(parts, dim=1), start


def image_positions(grid: tuple[int, int, int], start: int, merge: int) -> torch.Tensor:
    """[3, t * h * w / merge**2] positions of one image's tokens (row-major over its merged grid)
    from ``start``."""
    t, h, w = (int(v) for v in grid)
    axes = [torch.arange(n, dtype=torch.int64) + start for n in (t, h // merge, w // merge)]
    return torch.stack(torch.meshgrid(*axes, indexing="ij")).reshape(3, -1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k [T, heads, head_dim] rotated by cos and sin [T, rotary_dim] on their first
    ``rotary_dim`` features (rotate-half convention: feature j pairs with j + rotary_dim / 2); the
    rest pass unchanged. Computed in q's dtype, as transformers does for the text model."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    cos = cos[:, None].to(x.dtype)
    sin = sin[:, None].to(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    first, second = rot.chunk(2, dim=-1)
    rotated = rot * cos + torch.cat([-second, first], dim=-1) * sin
    return torch.cat([rotated, rest], dim=-1)
