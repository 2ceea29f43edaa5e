"""Memory layout of the projection weights on the CPU.

A decode step multiplies a few rows by every weight, so it waits on reading the weights, and MKL reads a weight
stored [in, out] (each input's row of outputs contiguous) 2-3x faster there than the [out, in] rows of a
PyTorch ``Linear`` whose output is the wider side: the LM head (32000 x 256) took 1.4 ms against 4.2 ms at batch 1,
a 1536 x 256 input projection 98 us against 211 us (one thread, weights out of cache). Where the input is the wider
side it is about even, and a prefill's large GEMMs do not mind either layout. So those weights are stored
transposed: the parameter keeps its [out, in] shape as a view of [in, out] memory, and ``F.linear`` hands MKL
the contiguous [in, out] matrix. Nothing else changes: loading is done by then, and every shape stays.

The experts' ``w13`` and ``w2`` are stored [in, out] whatever their shape: the fused C++ MoE of ``kernels/cpu``
vectorises along the contiguous output dimension (at H 256, 16 experts top-4 + shared, 32 tokens: 0.47 ms with
both [in, out], 0.79 ms with both [out, in]), and MKL's batched GEMMs of the reference do not mind.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from sglang_lite.layers.vocab import ParallelLMHead


def store_input_major(model: nn.Module) -> int:
    """Stores every projection weight whose output dimension is the larger as [in, out] in memory (see the module
    docstring), and the experts' ``w13`` [E, 2I, H] and ``w2`` [E, H, I] per expert whatever their shapes. A
    weight shared with another module (a tied embedding looks rows up) keeps its layout. Returns how many weights
    changed."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    changed = 0
    for weight in _projection_weights(model):
        wide_output = weight.dim() == 3 or weight.shape[-2] > weight.shape[-1]
        if uses[id(weight)] == 1 and wide_output and weight.is_contiguous():
            weight.data = weight.data.transpose(-1, -2).contiguous().transpose(-1, -2)
            changed += 1
    return changed


def _projection_weights(model: nn.Module) -> list[torch.Tensor]:
    weights = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, ParallelLMHead)):
            weights.append(module.weight)
        elif name.endswith("experts") and hasattr(module, "w13"):
            weights += [module.w13, module.w2]
    return [w for w in weights if w.dtype.is_floating_point and w.dim() in (2, 3)]
