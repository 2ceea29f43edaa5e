"""The quantization seam: a checkpoint's quantization config hands each module its weight scheme.

A ``QuantizationConfig`` (one per model: read from the checkpoint's ``quantization_config``, or made by
``--quantization`` for a high-precision checkpoint quantized at load) answers, for each module the checkpoint
names, which ``WeightScheme`` its weight is in (None: high precision). A ``WeightScheme`` is everything the loader
and the layers need of a format: how the values and their scales are stored (dtype, packing along the input
dimension, the block each scale covers), how to quantize and dequantize them, and how to multiply by them (a
linear layer, the MoE experts), through the kernels, which take the format as a parameter.

The loader (``models/quant_loading.py``) reads a quantized tensor's shards in whole blocks, and either keeps them
in the scheme's storage (``layers/quant.py``'s ``QuantLinear`` and ``QuantSparseMoeBlock`` hold them) or
dequantizes them into the model's dtype. A new format is one ``WeightScheme`` and one ``QuantizationConfig`` (see
``fp8.py``, ``mxfp4.py``) plus its kernels.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

# a MoE block's stored experts: (w13, w2, w13's scales, w2's scales)
Experts = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class WeightScheme(ABC):
    """How one quantized weight [..., out, in] is stored and multiplied: stored values of ``stored_dtype``, each
    holding ``pack`` consecutive inputs, and one scale of ``scale_dtype`` per ``block`` (out, in) of elements."""

    name: ClassVar[str]
    label: ClassVar[str]  # in messages: "block-FP8", "MXFP4"
    # the kernels' weight_format argument (None: told by the weight's dtype)
    kernel_format: ClassVar[str | None] = None
    # beside a weight ``w`` in checkpoints and in the model: ``w + scale_suffix`` holds its scales
    scale_suffix: ClassVar[str]
    scale_dtype: ClassVar[torch.dtype]
    pack: ClassVar[int] = 1
    block: tuple[int, int]
    # a shared expert of this format can be one more routed expert (the fused MoE's expert E)
    fuses_shared_experts: ClassVar[bool] = True

    @abstractmethod
    def stored_dtype(self, device: torch.device | str) -> torch.dtype:
        """The dtype of the stored values on ``device``."""

    @abstractmethod
    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(stored values, scales) of a high-precision [..., out, in] weight."""

    @abstractmethod
    def dequantize(
        self, values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """The weight [..., out, in] in ``dtype`` (exact where ``dtype`` holds it)."""

    @abstractmethod
    def linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``x @ W^T`` for the stored weight [out, in] and its scales."""

    @abstractmethod
    def fused_moe(
        self, x: torch.Tensor, experts: Experts, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """``kernels.fused_moe`` over stored experts ``(w13, w2, w13 scales, w2 scales)``."""

    @abstractmethod
    def describe(self) -> str:
        """One line for logs and /server_info."""

    def to_stored(
        self, values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Checkpoint values and scales as a parameter of ``dtype`` keeps them (the same real weights)."""
        return values, scales

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-1], shape[-1] // self.pack)

    def logical_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-1], shape[-1] * self.pack)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scales of a weight of (logical) ``shape``: one per block, the last ones partial."""
        rows, cols = shape[-2:]
        return (*shape[:-2], math.ceil(rows / self.block[0]), math.ceil(cols / self.block[1]))

    def check_logical_shape(self, shape: tuple[int, ...]) -> str | None:
        """Why a weight of this (logical) shape cannot be stored in the scheme (None: it can)."""
        return (
            None
            if shape[-1] % self.pack == 0
            else f"its {shape[-1]} inputs do not pack {self.pack} a value"
        )


class QuantizationConfig(ABC):
    """A model's quantization: which scheme each module's weight is in."""

    method: ClassVar[str]
    # the weight format's name (/server_info's "quantization")
    format_name: ClassVar[str]
    # the checkpoint's scale tensors end with this (their weight's name + it)
    scale_suffix: ClassVar[str]
    # the config's field that leaves modules unquantized
    exclusion_field: ClassVar[str]
    online: bool = False

    @abstractmethod
    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme of ``module``'s weight (a checkpoint module name), None where it stays high precision."""

    @abstractmethod
    def describe(self) -> str:
        """One line for logs and /server_info."""

    @property
    def fuses_shared_experts(self) -> bool:
        """Whether shared experts may join the routed ones (the format allows it for every scheme it uses)."""
        return True

    @property
    def quantizes_activations(self) -> bool:
        """Whether some scheme rounds activations too (its layers must be kept: dequantized weights would skip
        that)."""
        return False
