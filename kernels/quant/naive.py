"""Plain-PyTorch block FP8: weight blocks and their scales, per-token-group activation quantization, and the
block-FP8 GEMM as the reference (and CPU path) of the Triton kernels.

Layouts: a weight ``w`` [..., N, K] in an FP8 dtype with ``scale`` float32 [..., ceil(N / bn), ceil(K / bk)]
(``block = (bn, bk)``); real weight = ``w * scale`` over each block, the last block of a dimension may be partial.
Activations ``x`` [M, K] quantize per row and group of ``group`` columns: ``x_q`` [M, K] FP8, ``x_s`` float32
[M, ceil(K / group)].
"""

from __future__ import annotations

import torch

# the smallest group maximum a scale is computed from: an all-zero group gets a tiny scale, not a division by 0
MIN_AMAX = 1e-10


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def expand_blocks(
    scale: torch.Tensor, block: tuple[int, int], rows: int, cols: int
) -> torch.Tensor:
    """One scale per element of a [..., rows, cols] tensor from one per (bn x bk) block."""
    expanded = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return expanded[..., :rows, :cols]


def dequantize_blocks(
    w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``w * scale`` per block, computed in float32 (exact), returned in ``dtype``."""
    rows, cols = w.shape[-2:]
    if rows % block[0] or cols % block[1]:
        return (w.float() * expand_blocks(scale.float(), block, rows, cols)).to(dtype)
    # whole blocks: broadcast each scale over its block, no expanded copy of the scales
    blocks = (
        w.float()
        .unflatten(-1, (cols // block[1], block[1]))
        .unflatten(-3, (rows // block[0], block[0]))
    )
    return (blocks * scale.float()[..., :, None, :, None]).flatten(-2).flatten(-3, -2).to(dtype)


def quantize_blocks(
    w: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, float32 scales) with each block's largest magnitude mapped to the FP8 maximum."""
    rows, cols = w.shape[-2:]
    nb_rows, nb_cols = -(-rows // block[0]), -(-cols // block[1])
    padded = w.float().new_zeros(*w.shape[:-2], nb_rows * block[0], nb_cols * block[1])
    padded[..., :rows, :cols] = w.float()
    # [.., R, bn, C, bk]
    blocks = padded.unflatten(-1, (nb_cols, block[1])).unflatten(-3, (nb_rows, block[0]))
    amax = blocks.abs().amax(dim=(-3, -1)).clamp_min(MIN_AMAX)
    scale = amax / fp8_max(dtype)
    q = (
        (w.float() / expand_blocks(scale, block, rows, cols))
        .clamp(-fp8_max(dtype), fp8_max(dtype))
        .to(dtype)
    )
    return q, scale


def per_token_group_quant(
    x: torch.Tensor, group: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q [M, K] FP8, x_s float32 [M, ceil(K / group)]): each row's group of ``group`` columns
    scaled so its largest magnitude is the FP8 maximum."""
    num_cols = x.shape[-1]
    num_groups = -(-num_cols // group)
    padded = x.float().new_zeros(*x.shape[:-1], num_groups * group)
    padded[..., :num_cols] = x.float()
    groups = padded.unflatten(-1, (num_groups, group))
    scale = groups.abs().amax(-1).clamp_min(MIN_AMAX) / fp8_max(dtype)
    q = (groups / scale.unsqueeze(-1)).clamp(-fp8_max(dtype), fp8_max(dtype)).to(dtype)
    return q.flatten(-2)[..., :num_cols], scale


def dequantize_groups(x_q: torch.Tensor, x_s: torch.Tensor, group: int) -> torch.Tensor:
    """float32 ``x_q * x_s`` per token group."""
    return x_q.float() * x_s.repeat_interleave(group, dim=-1)[..., : x_q.shape[-1]]


def w8a8_block_fp8_matmul(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """``x @ W^T`` for x [M, K] (any float dtype) and the block-FP8 weight W [N, K]: x is quantized per token group
    of ``block[1]`` columns first, as the Triton kernel does; float32 arithmetic; output in x's dtype."""
    x_q, x_s = per_token_group_quant(x, block[1], w.dtype)
    return (dequantize_groups(x_q, x_s, block[1]) @ dequantize_blocks(w, w_scale, block).t()).to(
        x.dtype
    )


def e4m3fn_to_e4m3fnuz(w: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same real weights in e4m3fnuz (MI300): a bit pattern there is worth half its e4m3fn value, so the
    scales double; the pattern of -0 is NaN in fnuz and becomes +0."""
    bits = w.view(torch.int8).clone()
    bits[bits == -128] = 0
    return bits.view(torch.float8_e4m3fnuz), scale * 2.0
