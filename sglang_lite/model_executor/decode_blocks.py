"""Decode steps on the CPU as one C++ call per block (``kernels/cpu/blocks.py``): a layer's input norm with its
mixer, its post-attention norm with its MLP. Through the modules a decode layer is ~30 dispatched ops, whose Python
and dispatcher costs at batch 1 are most of a small model's step (docs/performance.md).

The runner turns them on once the weights are laid out, when everything they read is something the C++ kernels
take; a prefill's layers then take them too (``Qwen3_5DecoderLayer.forward``). Otherwise (and for DP attention and
torch.compile) the modules run as before.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang_lite.distributed import get_parallel_state
from sglang_lite.kernels import cpu as cpu_kernels
from sglang_lite.layers.mlp import Qwen3_5SparseMoeBlock
from sglang_lite.layers.quant import QuantLinear, QuantSparseMoeBlock

KERNEL_WEIGHTS = (torch.float32, torch.bfloat16)


def enable_decode_blocks(model: nn.Module, torch_compile: bool) -> str:
    """Turns the decode blocks on for ``model`` (its layers gather their weights now) when they can run it; says
    which, and why not."""
    reason = _why_not(model, torch_compile)
    if reason:
        return f"off ({reason})"
    for layer in model.model.layers:
        layer.prepare_decode_blocks()
    if hasattr(model, "mtp"):  # speculation's draft steps
        model.mtp.prepare_decode_blocks()
    model.model.reset_decode_layers()
    model.model.use_decode_blocks = True
    if hasattr(model, "mtp"):
        model.mtp.use_decode_blocks = True
    return "on"


def _why_not(model: nn.Module, torch_compile: bool) -> str:
    if torch_compile:
        return "torch.compile traces the modules"
    if not cpu_kernels.enabled():
        return "the C++ kernels are off"
    if get_parallel_state().config.dp_attention:
        return "DP attention gathers the MLPs' tokens"
    if model.compute_dtype != torch.float32:
        return f"activations in {model.compute_dtype}"
    for name, module in model.named_modules():
        reason = _module_blocker(module)
        if reason:
            return f"{name}: {reason}"
    return ""


def _module_blocker(module: nn.Module) -> str:
    if isinstance(module, Qwen3_5SparseMoeBlock):
        if module.ep_size > 1:
            return "expert parallelism"
        if any(gate.weight.dtype not in KERNEL_WEIGHTS for gate in _routers(module)):
            return "a quantized router"
    if getattr(module, "weight_format", None) == cpu_kernels.MXFP4:
        return _mxfp4_blocker(module)
    if isinstance(module, Qwen3_5SparseMoeBlock):
        if isinstance(module, QuantSparseMoeBlock) and module.weight_format != "fp8":
            return f"{module.weight_format} experts"
        if isinstance(module, QuantSparseMoeBlock) and not cpu_kernels.takes_moe(
            module.experts.w13, module.block
        ):
            return "FP8 experts the kernels do not take"
    if isinstance(module, QuantLinear):
        if module.weight_format != "fp8":
            return f"{module.weight_format} weights"
        if module.weight.stride(0) != 1 or module.block[0] % cpu_kernels.FP8_BLOCK_COLUMNS:
            return "an FP8 weight the kernels do not take"
    elif isinstance(module, nn.Linear) and module.weight.dtype not in KERNEL_WEIGHTS:
        return f"{module.weight.dtype} weights"
    return ""


def _routers(block: nn.Module) -> list[nn.Module]:
    """The MoE block's router and shared-expert gate, which the block multiplies unscaled."""
    return [block.gate, block.shared_expert_gate]


def _mxfp4_blocker(module: nn.Module) -> str:
    """Why an MXFP4 linear layer or MoE block cannot run in the blocks, or "": activations quantized too (W4A4,
    which the modules emulate), or a layout the kernels do not take."""
    if getattr(getattr(module, "scheme", None), "activations", False):
        return "MXFP4 activations (W4A4)"
    rows = torch.empty(1, 0)
    if isinstance(module, Qwen3_5SparseMoeBlock):
        experts = module.experts
        takes = all(cpu_kernels.takes_moe_mxfp4(rows, w) for w in (experts.w13, experts.w2))
        return "" if takes else "MXFP4 experts the kernels do not take"
    if not cpu_kernels.takes_linear_mxfp4(rows, module.weight):
        return "an MXFP4 weight the kernels do not take"
    return ""
