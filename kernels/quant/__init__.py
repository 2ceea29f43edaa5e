"""Block FP8 (DeepSeek / Qwen ``weight_block_size`` checkpoints): the W8A8 block GEMM with per-token-group dynamic
activation scales, and the block (de)quantization helpers the loader uses.

Each function runs the Triton kernel or the PyTorch reference per call (see ``kernels/dispatch.py``). The FP8
format is e4m3fn, except on MI300 (gfx942), whose matrix cores take e4m3fnuz (``fp8_dtype``).
"""

from __future__ import annotations

import torch

from .. import dispatch
from . import naive, triton_quant
from .naive import dequantize_blocks, e4m3fn_to_e4m3fnuz, quantize_blocks


def fp8_dtype(device: torch.device | str) -> torch.dtype:
    """The FP8 format the device computes in: e4m3fnuz on gfx942 (MI300), e4m3fn elsewhere (NVIDIA, MI355)."""
    on_gpu = torch.device(device).type == "cuda"
    if on_gpu and torch.version.hip and dispatch._hip_arch().startswith("gfx942"):
        return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def per_token_group_quant_fp8(
    x: torch.Tensor,
    group: int,
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q [M, K] in ``dtype``, x_s float32 [M, ceil(K / group)]), ``x = x_q * x_s`` per group of
    ``group`` columns of a row, its largest magnitude at the FP8 maximum."""
    if dispatch.use_triton(x, backend):
        return triton_quant.per_token_group_quant(x, group, dtype)
    return naive.per_token_group_quant(x, group, dtype)


def w8a8_block_fp8_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """``x @ W^T`` with W = ``w * w_scale`` per block: x [..., K] (float dtype; quantized per token group of
    ``block[1]`` columns), w [N, K] FP8, w_scale float32 [ceil(N / block[0]), ceil(K / block[1])] -> [..., N] in
    x's dtype."""
    flat = x.reshape(-1, x.shape[-1])
    if dispatch.use_triton(x, backend):
        x_q, x_s = triton_quant.per_token_group_quant(flat.contiguous(), block[1], w.dtype)
        out = triton_quant.w8a8_block_fp8_matmul(x_q, x_s, w, w_scale, block, x.dtype)
    else:
        out = naive.w8a8_block_fp8_matmul(flat, w, w_scale, block)
    return out.view(*x.shape[:-1], w.shape[0])


__all__ = [
    "dequantize_blocks",
    "e4m3fn_to_e4m3fnuz",
    "fp8_dtype",
    "per_token_group_quant_fp8",
    "quantize_blocks",
    "w8a8_block_fp8_matmul",
]
