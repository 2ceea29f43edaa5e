"""Bias-free linear layers: ``x @ weight^T``, the weight float32, bf16, or FP8 with block scales.

On the CPU, float32 inputs take the fused C++ kernel (``kernels.cpu.takes_linear`` says which): with float32
weights at a few rows (decode batches, short prompts), where MKL packs the whole weight for each call, which keeps
it far below the GEMM peak, and reads an [out, in] weight far below the memory bandwidth at batch 1
(docs/performance.md); with bf16 or FP8 weights at any size, each weight widened to float32 in registers.
``model_executor/weight_layout.py`` stores every projection [in, out] for it. Everything else, GPUs included, is
``F.linear`` on weights widened to x's dtype first, except under batch invariance (``kernels/batch_invariant.py``)
on a GPU: cuBLAS chooses its kernel and split of K by the row count too, so there the Triton matmul of
``triton_linear`` runs, its tiles and K order fixed whatever the rows. ``backend`` forces one (see
``kernels/dispatch.py``; ``"triton"`` runs the Triton matmul with or without the switch).
"""

from __future__ import annotations

import torch

from .. import batch_invariant, cpu
from ..dispatch import use_native, use_triton
from ..quant import mxfp4
from . import naive, triton_linear


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
    *,
    weight_format: str | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """x [..., K], weight [N, K] -> [..., N] in x's dtype. A weight of another dtype than x's is widened to it (in
    registers on the CPU); an FP8 weight is ``weight * weight_scale`` over blocks of ``block`` = (bn, bk), with
    ``weight_scale`` float32 [ceil(N / bn), ceil(K / bk)]: a weight-only dequantisation, x is not quantized (unlike
    ``w8a8_block_fp8_matmul``). ``weight_format="mxfp4"``: ``weight`` uint8 [N, K / 2] holds two e2m1 codes a byte
    and ``weight_scale`` uint8 [N, ceil(K / 32)] their e8m0 scales (``kernels/quant/mxfp4.py``), read as they are
    (weight-only: x is not quantized)."""
    if weight_format == "mxfp4":
        return _linear_mxfp4(x, weight, weight_scale, backend)
    if weight_format is not None:
        raise ValueError(f"unknown weight_format {weight_format!r}; expected None or 'mxfp4'")
    if cpu.takes_linear(x, weight, weight_scale, block) and use_native(x, backend=backend):
        if x.dim() == 2:
            return cpu.linear(x, weight, weight_scale, block)
        flat = cpu.linear(x.reshape(-1, x.shape[-1]), weight, weight_scale, block)
        return flat.view(*x.shape[:-1], weight.shape[0])
    if use_triton(x, backend) and (batch_invariant.enabled() or backend == "triton"):
        flat = triton_linear.linear(x.reshape(-1, x.shape[-1]), weight, weight_scale, block)
        return flat.view(*x.shape[:-1], weight.shape[0])
    return naive.linear(x, weight, weight_scale, block)


def _linear_mxfp4(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, backend: str | None
) -> torch.Tensor:
    k = mxfp4.check_shapes(weight, scale)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} columns, the MXFP4 weight {k}")
    flat = x.reshape(-1, k)
    if cpu.takes_linear_mxfp4(flat, weight) and use_native(x, backend=backend):
        out = cpu.linear_mxfp4(flat, weight, scale)
    elif use_triton(x, backend):
        out = triton_linear.linear_mxfp4(flat, weight, scale)
    else:
        out = mxfp4.linear(flat, weight, scale)
    return out.view(*x.shape[:-1], weight.shape[0])


__all__ = ["linear"]
