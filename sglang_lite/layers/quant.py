"""Block-FP8 layers: a linear layer and MoE experts whose weights stay FP8 in memory, each with its block scales.

A checkpoint quantized in ``weight_block_size`` blocks (``QuantConfig``) keeps, beside each quantized weight, a
float32 ``weight_scale_inv`` (one per block; real weight = weight * scale); online FP8 quantizes a high-precision
checkpoint into the same layout at load. On a GPU the loader swaps the projections it finds quantized for these
layers (``convert_to_fp8``) before filling them: the weight parameter holds FP8 data, its companion
``<name>_scale_inv`` the scales of the parameter's own blocks, and the forward runs the block-FP8 GEMM (activations
quantized per token group on the fly). The CPU's engine converts them too (where the blocks align) and its C++
kernels dequantize each weight in registers, activations kept float32; ``load_model`` alone dequantizes at load
there.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang_lite.kernels import fused_moe, linear, w8a8_block_fp8_matmul
from sglang_lite.layers.linear import PackedLinear
from sglang_lite.layers.mlp import Qwen3_5SparseMoeBlock

SCALE_SUFFIX = "_scale_inv"


def scale_shape(shape: torch.Size | tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scales of a [..., rows, cols] weight in ``block`` blocks: [..., ceil(rows / bn), ceil(cols / bk)]."""
    rows, cols = shape[-2:]
    return (*shape[:-2], -(-rows // block[0]), -(-cols // block[1]))


def _fp8_parameter(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)


class Fp8Linear(nn.Module):
    """A bias-free linear layer with a block-FP8 ``weight`` [out, in] and its ``weight_scale_inv``; built from the
    layer it replaces, whose ``output_sizes`` (a ``PackedLinear``'s packing) it keeps."""

    def __init__(self, linear: nn.Linear, block: tuple[int, int], dtype: torch.dtype) -> None:
        super().__init__()
        assert linear.bias is None, "block-FP8 linear layers carry no bias"
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.output_sizes = list(getattr(linear, "output_sizes", [linear.out_features]))
        self.block = tuple(block)
        device = linear.weight.device
        self.weight = _fp8_parameter(tuple(linear.weight.shape), dtype, device)
        self.weight_scale_inv = _fp8_parameter(
            scale_shape(linear.weight.shape, block), torch.float32, device
        )

    row_slices = PackedLinear.row_slices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return w8a8_block_fp8_matmul(x, self.weight, self.weight_scale_inv, self.block)
        # the CPU's C++ kernel dequantizes the weight in registers; x stays as it is (a weight-only product)
        return linear(x, self.weight, self.weight_scale_inv, self.block)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}"
        )


class Fp8SparseMoeBlock(Qwen3_5SparseMoeBlock):
    """The MoE block with block-FP8 experts (``experts.w13`` / ``w2`` FP8, ``w13_scale_inv`` / ``w2_scale_inv``);
    only the expert computation differs. ``convert_to_fp8`` turns a built block into one."""

    block: tuple[int, int]

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        experts = self.experts
        # as the plain block on a GPU: other ranks' pairs run on row 0 with weight 0
        if self.ep_size > 1:
            shared, local = ids == self.num_experts, ids - self.first_expert
            mine = shared | ((local >= 0) & (local < self.num_local))
            weights, ids = (
                weights * mine,
                torch.where(mine, torch.where(shared, self.num_local, local), 0),
            )
        return fused_moe(
            x,
            experts.w13,
            experts.w2,
            weights,
            ids.to(torch.int32),
            w13_scale=experts.w13_scale_inv,
            w2_scale=experts.w2_scale_inv,
            block=self.block,
        )


def fp8_capable_parameters(model: nn.Module) -> set[str]:
    """The parameters ``convert_to_fp8`` can turn FP8: each linear layer's ``weight``, each MoE block's
    ``experts.w13`` and ``experts.w2``."""
    names = set()
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, nn.Linear):
            names.add(f"{prefix}weight")
        if isinstance(module, Qwen3_5SparseMoeBlock):
            names.update((f"{prefix}experts.w13", f"{prefix}experts.w2"))
    return names


def convert_to_fp8(
    model: nn.Module, fp8_params: set[str], block: tuple[int, int], dtype: torch.dtype
) -> None:
    """Swaps each linear layer whose ``weight`` is in ``fp8_params`` for an ``Fp8Linear``, and makes each MoE block
    whose ``experts.w13`` and ``experts.w2`` both are an ``Fp8SparseMoeBlock`` with FP8 experts."""
    for name, module in list(model.named_modules()):
        prefix = f"{name}." if name else ""
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and f"{prefix}{child_name}.weight" in fp8_params:
                setattr(module, child_name, Fp8Linear(child, block, dtype))
        experts = (f"{prefix}experts.w13", f"{prefix}experts.w2")
        if isinstance(module, Qwen3_5SparseMoeBlock) and all(p in fp8_params for p in experts):
            _convert_experts(module, block, dtype)


def _convert_experts(
    block_module: Qwen3_5SparseMoeBlock, block: tuple[int, int], dtype: torch.dtype
) -> None:
    experts = block_module.experts
    for name in ("w13", "w2"):
        high = getattr(experts, name)
        setattr(experts, name, _fp8_parameter(tuple(high.shape), dtype, high.device))
        setattr(
            experts,
            name + SCALE_SUFFIX,
            _fp8_parameter(scale_shape(high.shape, block), torch.float32, high.device),
        )
    # the instance keeps its state; only the class, which decides how its experts run, changes
    block_module.__class__ = Fp8SparseMoeBlock
    block_module.block = tuple(block)
