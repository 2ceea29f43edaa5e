"""Memory layout of the projection weights on the CPU: every one stored [in, out].

A decode step multiplies a few rows by every weight. The fused linear kernel of ``kernels/cpu`` (``kernels.linear``,
which every projection and the LM head call) runs those rows through blocks of output columns, vectorised along
the contiguous output dimension of an [in, out] weight, and beats MKL from 1 to 256 rows at every projection of
Qwen3.5 from 16 columns on. MKL itself reads the wide [in, out] weights faster than [out, in] ones at batch 1, and a
prefill's large GEMMs do not mind either layout (the figures: docs/performance.md). So each
weight is stored transposed: the parameter keeps its [out, in] shape as a view of [in, out] memory, and
``F.linear`` hands MKL the contiguous [in, out] matrix where the fused kernel does not run. Nothing else changes:
loading is done by then, and every shape stays.

The experts' ``w13`` and ``w2`` are stored [in, out] too: the fused C++ MoE vectorises the same way and runs faster
on them than on [out, in] ones, and MKL's batched GEMMs of the reference do not mind. bf16 and FP8 weights are
stored the same way (the C++ kernels read FP8 ones only so; their block scales keep their layout).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from sglang_lite.layers.quant import QuantLinear
from sglang_lite.layers.vocab import ParallelLMHead


def store_input_major(model: nn.Module) -> int:
    """Stores every projection weight as [in, out] in memory (see the module docstring), the experts' ``w13``
    [E, 2I, H] and ``w2`` [E, H, I] per expert. A weight shared with another module (a tied embedding looks rows
    up) keeps its layout, and so does a one-row weight (both layouts are the same memory). Returns how many weights
    changed."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    changed = 0
    for weight in _projection_weights(model):
        if uses[id(weight)] == 1 and weight.shape[-2] > 1 and weight.is_contiguous():
            weight.data = weight.data.transpose(-1, -2).contiguous().transpose(-1, -2)
            changed += 1
    return changed


def _projection_weights(model: nn.Module) -> list[torch.Tensor]:
    weights = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, ParallelLMHead, QuantLinear)):
            weights.append(module.weight)
        elif name.endswith("experts") and hasattr(module, "w13"):
            weights += [module.w13, module.w2]
    return [w for w in weights if w.dtype.is_floating_point and w.dim() in (2, 3)]
