"""ModelConfig.from_hf normalises text configs, VL wrappers and the older rope spellings."""

from __future__ import annotations

import pytest
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

from sglang_lite.assets import TINY_MODEL_DIR
from sglang_lite.config import ModelConfig

SMALL = dict(
    hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=32
)


def test_moe_text_config():
    cfg = ModelConfig.from_hf(Qwen3_5MoeTextConfig(**SMALL, num_experts=4, num_experts_per_tok=2))
    assert cfg.is_moe and cfg.num_experts == 4 and cfg.num_experts_per_tok == 2
    assert (
        cfg.layer_types
        == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 2
    )
    assert cfg.rotary_dim == 8 and cfg.full_attention_layers == [3]


def test_dense_text_config_with_interval_and_tied_embeddings():
    cfg = ModelConfig.from_hf(
        Qwen3_5TextConfig(
            **SMALL, intermediate_size=96, full_attention_interval=3, tie_word_embeddings=True
        )
    )
    assert not cfg.is_moe and cfg.intermediate_size == 96 and cfg.tie_word_embeddings
    assert cfg.full_attention_layers == [2, 5]


@pytest.mark.parametrize("wrapper", ["qwen3_5", "qwen3_5_moe"])
def test_vl_wrapper_reads_text_config(wrapper):
    text = (
        Qwen3_5MoeTextConfig(**SMALL).to_dict()
        if wrapper == "qwen3_5_moe"
        else Qwen3_5TextConfig(**SMALL).to_dict()
    )
    text.pop(
        "model_type"
    )  # real wrappers may omit it; the wrapper type says which text model it is
    raw = {
        "model_type": wrapper,
        "text_config": text,
        "tie_word_embeddings": True,
        "vision_config": {},
    }
    cfg = ModelConfig.from_hf(raw)
    assert (
        cfg.is_moe == (wrapper == "qwen3_5_moe")
        and cfg.tie_word_embeddings
        and cfg.hidden_size == 64
    )


def test_transformers_wrapper_object():
    cfg = ModelConfig.from_hf(Qwen3_5MoeConfig(text_config=dict(SMALL)))
    assert cfg.is_moe and cfg.num_attention_heads == 4


def test_legacy_rope_fields_and_explicit_layer_types():
    raw = Qwen3_5TextConfig(**SMALL).to_dict()
    raw.pop("rope_parameters")
    raw.update(rope_theta=5e6, partial_rotary_factor=0.5, layer_types=["full_attention"] * 6)
    cfg = ModelConfig.from_hf(raw)
    assert cfg.rope_theta == 5e6 and cfg.rotary_dim == 16 and cfg.linear_attention_layers == []


def test_unknown_model_type_is_named():
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        ModelConfig.from_hf({"model_type": "llama"})


def test_builtin_tiny_model_config():
    cfg = ModelConfig.from_hf(str(TINY_MODEL_DIR))
    assert cfg.is_moe and cfg.vocab_size == 4096 and cfg.eos_token_ids == (4095,)
