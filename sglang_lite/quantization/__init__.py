"""Quantized weights behind one seam (``base.py``): the checkpoint's (or ``--quantization``'s) config hands each
module its ``WeightScheme``. Formats: block FP8 (``fp8.py``) and MXFP4 from AMD Quark exports (``mxfp4.py``);
unquantized weights have no scheme."""

from __future__ import annotations

from typing import Any

from sglang_lite.quantization.base import QuantizationConfig, WeightScheme
from sglang_lite.quantization.fp8 import ONLINE_FP8, Fp8BlockScheme, Fp8Config
from sglang_lite.quantization.mxfp4 import ONLINE_MXFP4, Mxfp4Scheme, QuarkConfig

# a checkpoint's quantization_config.quant_method -> its config class
CHECKPOINT_METHODS = {"fp8": Fp8Config, "quark": QuarkConfig}
# --quantization NAME on a high-precision checkpoint -> the config it quantizes at load with
ONLINE = {"fp8": ONLINE_FP8, "mxfp4": ONLINE_MXFP4}
# --quantization names a checkpoint of each method also answers to (its own config then applies)
ALIASES = {"fp8": ("fp8",), "quark": ("quark", "mxfp4")}


def from_checkpoint(raw: dict[str, Any]) -> QuantizationConfig:
    """The config of a checkpoint's ``quantization_config``; ValueError for a method or a field not served."""
    method = raw.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise ValueError(
            f"unsupported quantization_config quant_method {method!r}; expected one of "
            f"{tuple(CHECKPOINT_METHODS)}"
        )
    return CHECKPOINT_METHODS[method].from_dict(raw)


def in_use(
    checkpoint: QuantizationConfig | None, requested: str | None
) -> QuantizationConfig | None:
    """The quantization the weights run in: the checkpoint's, or ``requested`` (``--quantization``) made at load for
    a high-precision checkpoint; None for plain weights or ``"none"`` (a quantized checkpoint dequantized at load).
    ValueError when ``requested`` names another format than the checkpoint's."""
    if requested == "none":
        return None
    if checkpoint is None:
        if requested is not None and requested not in ONLINE:
            raise ValueError(
                f"--quantization {requested} runs a checkpoint's own {requested} quantization_config, and this "
                f"checkpoint has none; to quantize it at load use one of {tuple(ONLINE)}"
            )
        return ONLINE.get(requested) if requested is not None else None
    if requested is not None and requested not in ALIASES[checkpoint.method]:
        raise ValueError(
            f"--quantization {requested} on a checkpoint quantized as {checkpoint.method!r}: it cannot be "
            f"quantized again; use --quantization {ALIASES[checkpoint.method][-1]} (its own), or none to "
            "dequantize it at load"
        )
    return checkpoint


__all__ = [
    "CHECKPOINT_METHODS",
    "Fp8BlockScheme",
    "Fp8Config",
    "Mxfp4Scheme",
    "ONLINE",
    "ONLINE_FP8",
    "ONLINE_MXFP4",
    "QuarkConfig",
    "QuantizationConfig",
    "WeightScheme",
    "from_checkpoint",
    "in_use",
]
