"""The model configuration: a Hugging Face Qwen3.5 config normalised once into a frozen dataclass."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from sglang_lite import quantization
from sglang_lite.quantization import ONLINE_FP8, Fp8Config, QuantizationConfig  # noqa: F401 - re-exported

TEXT_MODEL_TYPES = {"qwen3_5_text": False, "qwen3_5_moe_text": True}
WRAPPER_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
LAYER_TYPES = ("linear_attention", "full_attention")
# kept for callers of the FP8-only names: the FP8 config is one implementation of the quantization seam now
QuantConfig = Fp8Config
QUANT_METHODS = tuple(quantization.CHECKPOINT_METHODS)


@dataclass(frozen=True)
class VisionSpec:
    """What a VL checkpoint says of its images: the vision tower's config (``vision_config``, kept as JSON so
    that the model config stays hashable), the special tokens and the text rotary's M-RoPE sections."""

    vision_json: str
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    video_token_id: int
    mrope_section: tuple[int, ...]

    @property
    def vision_config(self) -> dict[str, Any]:
        return json.loads(self.vision_json)

    @property
    def spatial_merge_size(self) -> int:
        return int(self.vision_config.get("spatial_merge_size", 2))


@dataclass(frozen=True)
class ModelConfig:
    is_moe: bool
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MLP: dense, or sparse MoE with a gated shared expert
    intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    quantization: QuantizationConfig | None = None  # the checkpoint's (None: plain weights)
    # the multi-token-prediction head's decoder layers (``mtp.*`` tensors), a draft model for speculation
    mtp_num_hidden_layers: int = 0
    # a VL checkpoint's vision tower and image tokens (None: text only)
    vision: VisionSpec | None = None

    def __post_init__(self) -> None:
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        assert not bad, f"unknown layer types {bad}"
        assert self.linear_num_value_heads % self.linear_num_key_heads == 0, (
            "linear value heads % key heads != 0"
        )
        assert self.num_attention_heads % self.num_key_value_heads == 0, (
            "attention heads % kv heads != 0"
        )
        assert 0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0, (
            f"bad rotary_dim {self.rotary_dim}"
        )

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    def attention_shard(self, attn_tp_size: int) -> ModelConfig:
        """The head counts one rank of an attention group of ``attn_tp_size`` holds (the pools and the attention
        layers are built from it). KV heads fewer than the ranks are replicated: each rank keeps the one its query
        heads use. Raises ValueError naming the size that does not divide."""
        if attn_tp_size == 1:
            return self
        kv_heads = self.num_key_value_heads
        if kv_heads < attn_tp_size:
            if attn_tp_size % kv_heads:
                raise ValueError(
                    f"num_key_value_heads ({kv_heads}) must divide the attention tp size "
                    f"({attn_tp_size}) to be replicated over it"
                )
            kv_heads = 1
        else:
            kv_heads = shard_size(kv_heads, attn_tp_size, "num_key_value_heads")
        return dataclasses.replace(
            self,
            num_attention_heads=shard_size(
                self.num_attention_heads, attn_tp_size, "num_attention_heads"
            ),
            num_key_value_heads=kv_heads,
            linear_num_key_heads=shard_size(
                self.linear_num_key_heads, attn_tp_size, "linear_num_key_heads"
            ),
            linear_num_value_heads=shard_size(
                self.linear_num_value_heads, attn_tp_size, "linear_num_value_heads"
            ),
        )

    @classmethod
    def from_hf(cls, source: str | os.PathLike | dict[str, Any] | Any) -> ModelConfig:
        """From a checkpoint folder, a config.json path, a config dict or a transformers PretrainedConfig."""
        return cls.from_dict(_read_hf_dict(source))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        text, outer = _text_section(raw)
        rope = _rope_parameters(text)
        head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        return cls(
            is_moe=TEXT_MODEL_TYPES[text["model_type"]],
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            layer_types=_layer_types(text),
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            # a VL wrapper ties (or not) at the top level, which is what the wrapped model follows
            tie_word_embeddings=bool(
                outer.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            ),
            max_position_embeddings=text.get("max_position_embeddings", 32768),
            num_attention_heads=text["num_attention_heads"],
            num_key_value_heads=text.get("num_key_value_heads", text["num_attention_heads"]),
            head_dim=head_dim,
            rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 0.25)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            linear_num_key_heads=text["linear_num_key_heads"],
            linear_num_value_heads=text["linear_num_value_heads"],
            linear_key_head_dim=text["linear_key_head_dim"],
            linear_value_head_dim=text["linear_value_head_dim"],
            linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
            intermediate_size=text.get("intermediate_size", 0) or 0,
            num_experts=text.get("num_experts", 0) or 0,
            num_experts_per_tok=text.get("num_experts_per_tok", 0) or 0,
            moe_intermediate_size=text.get("moe_intermediate_size", 0) or 0,
            shared_expert_intermediate_size=text.get("shared_expert_intermediate_size", 0) or 0,
            eos_token_ids=_as_tuple(text.get("eos_token_id", outer.get("eos_token_id"))),
            pad_token_id=text.get("pad_token_id", outer.get("pad_token_id")),
            quantization=_quantization(text, outer),
            mtp_num_hidden_layers=text.get("mtp_num_hidden_layers", 0) or 0,
            vision=_vision(outer, rope),
        )


def shard_size(size: int, parts: int, name: str, over: str = "tp size") -> int:
    """``size / parts``, or ValueError naming the size and the tp (or ep) size when it does not divide."""
    if size % parts:
        raise ValueError(
            f"{name} ({size}) is not divisible by the {over} ({parts}): it cannot be sharded"
        )
    return size // parts


def _read_hf_dict(source: Any) -> dict[str, Any]:
    if isinstance(source, dict):
        return source
    if hasattr(source, "to_dict"):
        return source.to_dict()
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        return json.load(f)


def _text_section(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Returns (text config, wrapper config); the VL wrappers keep the language model under ``text_config``."""
    model_type = raw.get("model_type")
    if model_type in WRAPPER_MODEL_TYPES:
        text = dict(raw.get("text_config") or {})
        text.setdefault("model_type", WRAPPER_MODEL_TYPES[model_type])
        return text, raw
    if model_type not in TEXT_MODEL_TYPES:
        known = sorted(TEXT_MODEL_TYPES) + sorted(WRAPPER_MODEL_TYPES)
        raise ValueError(f"unsupported model_type {model_type!r}; expected one of {known}")
    return raw, {}


def _rope_parameters(text: dict[str, Any]) -> dict[str, Any]:
    """Merges the transformers 5 ``rope_parameters`` with the older top-level / ``rope_scaling`` spellings."""
    merged = {k: text[k] for k in ("rope_theta", "partial_rotary_factor") if k in text}
    for key in ("rope_scaling", "rope_parameters"):
        merged.update(text.get(key) or {})
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    return merged


def _layer_types(text: dict[str, Any]) -> tuple[str, ...]:
    if text.get("layer_types"):
        return tuple(text["layer_types"][: text["num_hidden_layers"]])
    interval = text.get("full_attention_interval", 4)
    return tuple(
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(text["num_hidden_layers"])
    )


def quantization_config_in_use(
    config: ModelConfig, requested: str | None
) -> QuantizationConfig | None:
    """The quantization the model's weights run in (``requested``: ``--quantization``): the checkpoint's
    quantization_config, the online config of ``"fp8"`` / ``"mxfp4"`` on a checkpoint without one (quantized at
    load), None for plain weights or ``"none"`` (a quantized checkpoint dequantized at load)."""
    return quantization.in_use(config.quantization, requested)


def quantization_in_use(config: ModelConfig, requested: str | None) -> str:
    """The weight format the model runs (``"fp8"``, ``"mxfp4"``), its checkpoint's or made at load, else
    ``"none"``."""
    quant = quantization_config_in_use(config, requested)
    return "none" if quant is None else quant.format_name


def _quantization(text: dict[str, Any], outer: dict[str, Any]) -> QuantizationConfig | None:
    """A VL wrapper may keep ``quantization_config`` at its top level rather than in ``text_config``."""
    raw = text.get("quantization_config") or outer.get("quantization_config")
    return quantization.from_checkpoint(raw) if raw else None


def _vision(outer: dict[str, Any], rope: dict[str, Any]) -> VisionSpec | None:
    """A VL wrapper's vision tower and image tokens (transformers' defaults for the ids it omits)."""
    if not outer.get("vision_config"):
        return None
    return VisionSpec(
        vision_json=json.dumps(outer["vision_config"], sort_keys=True),
        image_token_id=int(outer.get("image_token_id", 248056)),
        vision_start_token_id=int(outer.get("vision_start_token_id", 248053)),
        vision_end_token_id=int(outer.get("vision_end_token_id", 248054)),
        video_token_id=int(outer.get("video_token_id", 248057)),
        mrope_section=tuple(rope.get("mrope_section", (11, 11, 10))),
    )


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)
