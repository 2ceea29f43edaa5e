"""MXFP4 weights: AMD Quark's OCP-MX export (``quant_method: "quark"``) and ``--quantization mxfp4`` at load.

Quark's ``quantization_config`` decides per module: a module an ``exclude`` pattern (fnmatch) matches stays high
precision; otherwise the first ``layer_quant_config`` pattern it matches, else its type's entry in
``layer_type_quant_config`` (every module here is a ``Linear``), else ``global_quant_config``, gives its spec. The
one spec served is MXFP4: ``weight`` fp4 per 32-group with e8m0 scales (a quantized ``<module>.weight`` uint8
[out, in / 2] with ``<module>.weight_scale`` uint8 [out, ceil(in / 32)]); ``input_tensors`` null (W4A16) or fp4
per 32-group quantized at run time (W4A4, emulated: activations are rounded through MXFP4 before each product).
Anything else a config asks for (fp6 or fp8 weights, static input scales, output or bias quantization, a quantized
KV cache) is refused at load with the field named. With MXFP4 the shared experts run beside the routed ones (no
fusion), as upstream does.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from sglang_lite.kernels import fused_moe, linear
from sglang_lite.kernels.moe import naive as moe_naive
from sglang_lite.kernels.quant import mxfp4
from sglang_lite.quantization.base import Experts, QuantizationConfig, WeightScheme
from sglang_lite.quantization.fp8 import text_name

SCALE_SUFFIX = "_scale"
# left high precision by --quantization mxfp4 (and quark_export's default): the routers, the linear attention, the
# embeddings, the LM head, the MTP head and a vision tower
DEFAULT_EXCLUDE = (
    "lm_head",
    "*embed_tokens",
    "*mlp.gate",
    "*mlp.shared_expert_gate",
    "*linear_attn*",
    "*visual*",
    "mtp*",
    "*.mtp.*",
)
LINEAR_TYPE = "Linear"


@dataclass(frozen=True)
class Mxfp4Scheme(WeightScheme):
    """e2m1 codes two a byte with an e8m0 scale per 32 inputs of a row; ``activations``: W4A4."""

    name: ClassVar[str] = "mxfp4"
    label: ClassVar[str] = "MXFP4"
    kernel_format: ClassVar[str | None] = "mxfp4"
    scale_suffix: ClassVar[str] = SCALE_SUFFIX
    scale_dtype: ClassVar[torch.dtype] = torch.uint8
    pack: ClassVar[int] = 2
    fuses_shared_experts: ClassVar[bool] = False
    block: tuple[int, int] = (1, mxfp4.GROUP)
    activations: bool = False
    scale_mode: str = "even"

    def stored_dtype(self, device: torch.device | str) -> torch.dtype:
        return torch.uint8

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return mxfp4.quantize(w, self.scale_mode)

    def dequantize(
        self, values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        return mxfp4.dequantize(values, scales, dtype)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.activations:
            x = mxfp4.quantize_dequantize(x, self.scale_mode)
        return linear(x, weight, scale, weight_format="mxfp4")

    def fused_moe(
        self, x: torch.Tensor, experts: Experts, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        w13, w2, w13_scale, w2_scale = experts
        if self.activations:
            scales = (w13_scale, w2_scale)
            return moe_naive.fused_moe_mxfp4(
                x, w13, w2, weights, ids, *scales, activations=self.scale_mode
            )
        scales = {"w13_scale": w13_scale, "w2_scale": w2_scale}
        return fused_moe(x, w13, w2, weights, ids, **scales, weight_format="mxfp4")

    def check_logical_shape(self, shape: tuple[int, ...]) -> str | None:
        if shape[-1] % 2:
            return f"its {shape[-1]} inputs are odd (MXFP4 packs two a byte)"
        return None

    def describe(self) -> str:
        acts = (
            f"fp4 per {mxfp4.GROUP} at run time (W4A4)"
            if self.activations
            else "unquantized (W4A16)"
        )
        return f"mxfp4 (e2m1 weights, e8m0 scales per {mxfp4.GROUP} inputs; activations {acts})"


@dataclass(frozen=True)
class QuarkConfig(QuantizationConfig):
    """A Quark ``quantization_config`` (or the one ``--quantization mxfp4`` makes): per-module MXFP4 schemes."""

    method: ClassVar[str] = "quark"
    format_name: ClassVar[str] = "mxfp4"
    exclusion_field: ClassVar[str] = "exclude (or a spec without weight)"
    scale_suffix: ClassVar[str] = SCALE_SUFFIX
    global_scheme: Mxfp4Scheme | None = None
    # (fnmatch pattern, scheme or None) in the config's order
    layer_schemes: tuple[tuple[str, Mxfp4Scheme | None], ...] = ()
    linear_scheme: Mxfp4Scheme | None = None
    has_linear_type: bool = False
    exclude: tuple[str, ...] = ()
    online: bool = False

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> QuarkConfig:
        _refuse_unsupported(raw)
        layer_types = raw.get("layer_type_quant_config") or {}
        return cls(
            global_scheme=_scheme(raw.get("global_quant_config"), "global_quant_config"),
            layer_schemes=tuple(
                (pattern, _scheme(spec, f"layer_quant_config[{pattern!r}]"))
                for pattern, spec in (raw.get("layer_quant_config") or {}).items()
            ),
            linear_scheme=_scheme(
                layer_types.get(LINEAR_TYPE), f"layer_type_quant_config[{LINEAR_TYPE!r}]"
            ),
            has_linear_type=LINEAR_TYPE in layer_types,
            exclude=tuple(raw.get("exclude") or ()),
        )

    def scheme_for(self, module: str) -> WeightScheme | None:
        names = {module, text_name(module)}
        if any(fnmatch.fnmatchcase(n, p) for n in names for p in self.exclude):
            return None
        for pattern, scheme in self.layer_schemes:
            if any(fnmatch.fnmatchcase(n, pattern) for n in names):
                return scheme
        return self.linear_scheme if self.has_linear_type else self.global_scheme

    @property
    def fuses_shared_experts(self) -> bool:
        return False

    @property
    def quantizes_activations(self) -> bool:
        schemes = [self.global_scheme, self.linear_scheme, *(s for _, s in self.layer_schemes)]
        return any(s is not None and s.activations for s in schemes)

    def describe(self) -> str:
        schemes = {s for s in (self.global_scheme, self.linear_scheme) if s is not None}
        schemes |= {s for _, s in self.layer_schemes if s is not None}
        shown = "; ".join(sorted(s.describe() for s in schemes)) or "no quantized modules"
        online = ", quantized at load" if self.online else ""
        return f"{self.method} ({shown}; {len(self.exclude)} exclude patterns{online})"


# --quantization mxfp4 on a high-precision checkpoint: W4A16, what DEFAULT_EXCLUDE leaves out in high precision
ONLINE_MXFP4 = QuarkConfig(global_scheme=Mxfp4Scheme(), exclude=DEFAULT_EXCLUDE, online=True)


def _refuse_unsupported(raw: dict[str, Any]) -> None:
    kv_groups = (raw.get("export") or {}).get("kv_cache_group") or raw.get("kv_cache_group")
    if raw.get("kv_cache_quant_config") or kv_groups:
        raise ValueError(
            "unsupported Quark quantization_config: kv_cache_quant_config / kv_cache_group (a quantized KV "
            "cache; the KV cache here is kept in the model dtype)"
        )
    if raw.get("softmax_quant_spec"):
        raise ValueError("unsupported Quark quantization_config: softmax_quant_spec")


def _scheme(spec: dict[str, Any] | None, where: str) -> Mxfp4Scheme | None:
    """The MXFP4 scheme a Quark quant config entry describes (None: no weight quantization)."""
    if not spec or spec.get("weight") is None:
        return None
    for key in ("output_tensors", "bias"):
        if spec.get(key) is not None:
            raise ValueError(
                f"unsupported Quark quantization_config: {where}.{key} is set (only weights, and "
                "activations of W4A4, are quantized here)"
            )
    mode = _check_fp4(spec["weight"], f"{where}.weight", dynamic=False)
    inputs = spec.get("input_tensors")
    if inputs is not None:
        _check_fp4(inputs, f"{where}.input_tensors", dynamic=True)
    return Mxfp4Scheme(activations=inputs is not None, scale_mode=mode)


def _check_fp4(spec: dict[str, Any], where: str, dynamic: bool) -> str:
    """The scale mode of an MXFP4 spec; ValueError naming the field that is not MXFP4."""
    if (spec.get("scale_format") or "e8m0") != "e8m0":
        raise _not_mxfp4(where, "scale_format", spec.get("scale_format"))
    for key, value in {"dtype": "fp4", "qscheme": "per_group", "group_size": mxfp4.GROUP}.items():
        if spec.get(key) != value:
            raise _not_mxfp4(where, key, spec.get(key))
    if bool(spec.get("is_dynamic", dynamic)) != dynamic:
        kind = "dynamic" if dynamic else "static"
        raise ValueError(
            f"unsupported Quark quantization_config: {where}.is_dynamic is {spec.get('is_dynamic')!r}; "
            f"only {kind} {'activation' if dynamic else 'weight'} scales are supported"
        )
    mode = spec.get("scale_calculation_mode") or "even"
    if mode not in mxfp4.SCALE_MODES:
        raise ValueError(
            f"unsupported Quark quantization_config: {where}.scale_calculation_mode {mode!r}; expected one of "
            f"{mxfp4.SCALE_MODES}"
        )
    return mode


def _not_mxfp4(where: str, key: str, found: Any) -> ValueError:
    return ValueError(
        f"unsupported Quark quantization_config: {where}.{key} is {found!r}; only MXFP4 (fp4 per_group of "
        f"{mxfp4.GROUP} with e8m0 scales) is supported"
    )
