"""Bias-free linear layers: ``x @ weight^T``.

On the CPU, float32 inputs of a few rows (decode batches, short prompts) take the fused C++ kernel
(``kernels.cpu.takes_linear`` says which): MKL packs the whole weight for each call, which at a few rows keeps it
far below the GEMM peak, and reads an [out, in] weight far below the memory bandwidth at batch 1
(docs/performance.md).
``model_executor/weight_layout.py`` stores every projection [in, out] for it. Everything else, GPUs included, is
``F.linear``; ``backend`` forces one (see ``kernels/dispatch.py``).
"""

from __future__ import annotations

import torch

from .. import cpu
from ..dispatch import use_native
from . import naive


def linear(x: torch.Tensor, weight: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K] -> [..., N]."""
    if cpu.takes_linear(x, weight) and use_native(x, weight, backend=backend):
        if x.dim() == 2:
            return cpu.linear(x, weight)
        return cpu.linear(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
    return naive.linear(x, weight)


__all__ = ["linear"]
