"""Quantized layers: a linear layer and MoE experts whose weights stay in their quantization's storage, each with
its scales, multiplied by the scheme's kernels (``quantization/base.py``'s ``WeightScheme``).

The loader builds the model in high precision, then swaps each projection whose checkpoint weight it keeps
quantized for a ``QuantLinear`` and turns each such MoE block into a ``QuantSparseMoeBlock`` (``convert``), before
filling them: the weight parameter holds the stored values (FP8: [out, in] e4m3; MXFP4: uint8 [out, in / 2]), its
companion ``weight<scale_suffix>`` (``weight_scale_inv``, ``weight_scale``) the scales of the parameter's own
blocks, and the forward runs the scheme's product.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang_lite.layers.linear import PackedLinear
from sglang_lite.layers.mlp import Qwen3_5SparseMoeBlock
from sglang_lite.quantization import Fp8BlockScheme, WeightScheme

# the FP8 scales' name beside a weight (kept for the FP8 helpers of the benchmarks)
SCALE_SUFFIX = Fp8BlockScheme.scale_suffix


def scale_shape(shape: torch.Size | tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scales of a [..., rows, cols] weight in ``block`` blocks: [..., ceil(rows / bn), ceil(cols / bk)]."""
    return Fp8BlockScheme(tuple(block)).scale_shape(tuple(shape))


def _parameter(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)


class _SchemeHolder:
    """What the decode blocks and the loader read of a quantized layer's scheme."""

    scheme: WeightScheme

    @property
    def weight_format(self) -> str:
        return self.scheme.name

    @property
    def block(self) -> tuple[int, int]:
        return self.scheme.block


class QuantLinear(_SchemeHolder, nn.Module):
    """A bias-free linear layer with a quantized ``weight`` and its scales in ``scheme``; built from the layer it
    replaces, whose ``output_sizes`` (a ``PackedLinear``'s packing) it keeps."""

    def __init__(self, linear: nn.Linear, scheme: WeightScheme, dtype: torch.dtype) -> None:
        super().__init__()
        assert linear.bias is None, "quantized linear layers carry no bias"
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.output_sizes = list(getattr(linear, "output_sizes", [linear.out_features]))
        self.scheme = scheme
        shape = tuple(linear.weight.shape)
        device = linear.weight.device
        self.weight = _parameter(scheme.stored_shape(shape), dtype, device)
        scales = _parameter(scheme.scale_shape(shape), scheme.scale_dtype, device)
        self.register_parameter(self.scale_name, scales)

    row_slices = PackedLinear.row_slices

    @property
    def scale_name(self) -> str:
        return "weight" + self.scheme.scale_suffix

    @property
    def weight_scales(self) -> torch.Tensor:
        return getattr(self, self.scale_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scheme.linear(x, self.weight, self.weight_scales)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.scheme.describe()}"
        )


class QuantSparseMoeBlock(_SchemeHolder, Qwen3_5SparseMoeBlock):
    """The MoE block with quantized experts (``experts.w13`` / ``w2`` stored in ``scheme``, their scales beside
    them); only the expert computation differs. ``convert`` turns a built block into one."""

    def expert_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w13, w2, their scales)."""
        experts, suffix = self.experts, self.scheme.scale_suffix
        return (
            experts.w13,
            experts.w2,
            getattr(experts, "w13" + suffix),
            getattr(experts, "w2" + suffix),
        )

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # as the plain block on a GPU: other ranks' pairs run on row 0 with weight 0
        if self.ep_size > 1:
            shared, local = ids == self.num_experts, ids - self.first_expert
            mine = shared | ((local >= 0) & (local < self.num_local))
            weights, ids = (
                weights * mine,
                torch.where(mine, torch.where(shared, self.num_local, local), 0),
            )
        return self.scheme.fused_moe(x, self.expert_tensors(), weights, ids.to(torch.int32))


def quantizable_parameters(model: nn.Module) -> set[str]:
    """The parameters ``convert`` can keep quantized: each linear layer's ``weight``, each MoE block's
    ``experts.w13`` and ``experts.w2``."""
    names = set()
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, nn.Linear):
            names.add(f"{prefix}weight")
        if isinstance(module, Qwen3_5SparseMoeBlock):
            names.update((f"{prefix}experts.w13", f"{prefix}experts.w2"))
    return names


def convert(model: nn.Module, schemes: dict[str, WeightScheme], device: torch.device | str) -> None:
    """Swaps each linear layer whose ``weight`` ``schemes`` names for a ``QuantLinear`` in its scheme, and makes
    each MoE block whose ``experts.w13`` and ``experts.w2`` both are named a ``QuantSparseMoeBlock``."""
    for name, module in list(model.named_modules()):
        prefix = f"{name}." if name else ""
        for child_name, child in list(module.named_children()):
            scheme = schemes.get(f"{prefix}{child_name}.weight")
            if isinstance(child, nn.Linear) and scheme is not None:
                setattr(module, child_name, QuantLinear(child, scheme, scheme.stored_dtype(device)))
        experts = [schemes.get(f"{prefix}experts.{w}") for w in ("w13", "w2")]
        if isinstance(module, Qwen3_5SparseMoeBlock) and None not in experts:
            assert experts[0] == experts[1], f"{name}: w13 and w2 in different schemes"
            _convert_experts(module, experts[0], experts[0].stored_dtype(device))


def _convert_experts(
    block_module: Qwen3_5SparseMoeBlock, scheme: WeightScheme, dtype: torch.dtype
) -> None:
    experts = block_module.experts
    for name in ("w13", "w2"):
        high = getattr(experts, name)
        shape = tuple(high.shape)
        setattr(experts, name, _parameter(scheme.stored_shape(shape), dtype, high.device))
        scales = _parameter(scheme.scale_shape(shape), scheme.scale_dtype, high.device)
        setattr(experts, name + scheme.scale_suffix, scales)
    # the instance keeps its state; only the class, which decides how its experts run, changes
    block_module.__class__ = QuantSparseMoeBlock
    block_module.scheme = scheme
