"""The text rotary's M-RoPE table (``RotaryEmbedding.mrope_table``, what a prompt with images rotates by) equals
transformers' interleaved recomposition, and a text token's row equals the 1-D table's."""

from __future__ import annotations

import torch
from transformers import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

from sglang_lite.layers.rotary import RotaryEmbedding


def test_mrope_table_equals_transformers():
    config = Qwen3_5MoeTextConfig(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10]},
    )  # fmt: skip
    theirs = Qwen3_5MoeTextRotaryEmbedding(config)
    ours = RotaryEmbedding(64, 4096, 10000.0, (11, 11, 10))
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 4000, (3, 50), generator=gen)
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    table = ours.mrope_table(positions)
    half = 32
    assert torch.allclose(table[:, :half], cos[0, :, :half], atol=1e-6)
    assert torch.allclose(table[:, half:], sin[0, :, :half], atol=1e-6)
    text = torch.arange(50).expand(3, -1)
    assert torch.equal(ours.mrope_table(text), ours.cos_sin_cache[:50])
