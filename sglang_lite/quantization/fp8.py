"""Block FP8 (DeepSeek / Qwen ``weight_block_size`` checkpoints, and ``--quantization fp8`` at load).

A checkpoint quantized in ``weight_block_size`` blocks keeps, beside each quantized weight, a float32
``weight_scale_inv`` (one per block; real weight = weight * scale); some modules stay high precision
(``modules_to_not_convert``). Online FP8 quantizes a high-precision checkpoint into the same layout at load. On a
GPU activations are quantized per token group at run time (the W8A8 block GEMM); the CPU's C++ kernels dequantize
each weight in registers and keep activations float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from sglang_lite.kernels import fused_moe, linear, w8a8_block_fp8_matmul
from sglang_lite.kernels.quant import (
    dequantize_blocks,
    e4m3fn_to_e4m3fnuz,
    fp8_dtype,
    quantize_blocks,
)
from sglang_lite.quantization.base import Experts, QuantizationConfig, WeightScheme

SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True)
class Fp8BlockScheme(WeightScheme):
    """e4m3 values (e4m3fnuz on MI300) with a float32 scale per ``block`` (out, in) block."""

    name: ClassVar[str] = "fp8"
    label: ClassVar[str] = "block-FP8"
    scale_suffix: ClassVar[str] = SCALE_SUFFIX
    scale_dtype: ClassVar[torch.dtype] = torch.float32
    block: tuple[int, int] = (128, 128)

    def stored_dtype(self, device: torch.device | str) -> torch.dtype:
        return fp8_dtype(device)

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_blocks(w, self.block, torch.float8_e4m3fn)

    def dequantize(
        self, values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        return dequantize_blocks(values, scales, self.block, dtype)

    def to_stored(
        self, values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype == torch.float8_e4m3fnuz:
            return e4m3fn_to_e4m3fnuz(values, scales)
        return values, scales

    def linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return w8a8_block_fp8_matmul(x, weight, scale, self.block)
        # the CPU's C++ kernel dequantizes the weight in registers; x stays as it is (a weight-only product)
        return linear(x, weight, scale, self.block)

    def fused_moe(
        self, x: torch.Tensor, experts: Experts, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        w13, w2, w13_scale, w2_scale = experts
        scales = {"w13_scale": w13_scale, "w2_scale": w2_scale}
        return fused_moe(x, w13, w2, weights, ids, **scales, block=self.block)

    def describe(self) -> str:
        rows, cols = self.block
        return f"fp8 (e4m3, {rows}x{cols} weight blocks, dynamic activation scales)"


@dataclass(frozen=True)
class Fp8Config(QuantizationConfig):
    """A checkpoint's block-FP8 ``quantization_config`` (or ``ONLINE_FP8``): block-wise e4m3 weights, activations
    quantized at run time per token group, the modules ``modules_to_not_convert`` names left unconverted."""

    method: ClassVar[str] = "fp8"
    format_name: ClassVar[str] = "fp8"
    exclusion_field: ClassVar[str] = "modules_to_not_convert"
    scale_suffix: ClassVar[str] = SCALE_SUFFIX
    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"
    block_size: tuple[int, int] = (128, 128)
    modules_to_not_convert: tuple[str, ...] = ()
    online: bool = False  # not the checkpoint's: a high-precision checkpoint quantized at load

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Fp8Config:
        config = cls(
            fmt=raw.get("fmt", "e4m3"),
            activation_scheme=raw.get("activation_scheme", "dynamic"),
            block_size=tuple(raw.get("weight_block_size") or ()),
            modules_to_not_convert=tuple(raw.get("modules_to_not_convert") or ()),
        )
        if (
            config.fmt != "e4m3"
            or config.activation_scheme != "dynamic"
            or len(config.block_size) != 2
        ):
            raise ValueError(
                f"unsupported fp8 quantization_config (fmt {config.fmt!r}, activation_scheme "
                f"{config.activation_scheme!r}, weight_block_size {list(config.block_size)}): only e4m3 "
                "weights in 2-D blocks with dynamic activation scales are supported"
            )
        return config

    def converts(self, module: str) -> bool:
        """False for a module ``modules_to_not_convert`` names: itself, a module inside it, or a pattern of whole
        dotted components (``lm_head``, ``linear_attn.in_proj_a``); the VL prefix ``model.language_model.`` and
        the text one ``model.`` are the same."""
        name = f".{text_name(module)}."
        return not any(f".{text_name(p)}." in name for p in self.modules_to_not_convert)

    def scheme_for(self, module: str) -> WeightScheme | None:
        return Fp8BlockScheme(self.block_size) if self.converts(module) else None

    def describe(self) -> str:
        rows, cols = self.block_size
        online = ", quantized at load" if self.online else ""
        return (
            f"{self.method} ({self.fmt}, {rows}x{cols} weight blocks, {self.activation_scheme} activation "
            f"scales{online})"
        )


# --quantization fp8 on a high-precision checkpoint: 128x128 e4m3 blocks as the block-FP8 checkpoints; the LM head,
# the routers and the small GDN a/b projections stay in high precision
ONLINE_FP8 = Fp8Config(
    online=True,
    modules_to_not_convert=(
        "lm_head",
        "mlp.gate",
        "mlp.shared_expert_gate",
        "linear_attn.in_proj_a",
        "linear_attn.in_proj_b",
    ),
)


def text_name(name: str) -> str:
    """A checkpoint name with the VL prefix ``model.language_model.`` read as the text model's ``model.``."""
    return (
        "model." + name[len("model.language_model.") :]
        if name.startswith("model.language_model.")
        else name
    )
