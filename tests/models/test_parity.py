"""load_model logits equal the transformers reference (float32, relative error < 1e-4)."""

from __future__ import annotations

import pytest
import torch

from sglang_lite import load_model
from sglang_lite.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from tests.hf_checkpoints import make_hf_model, save_checkpoint

SEQ_LENS = (1, 63, 64, 65, 200)

CASES = {
    "moe": dict(moe=True),
    "dense": dict(moe=False),
    "moe_hv_hk_3_odd_dims_tied": dict(
        moe=True,
        linear_num_key_heads=1,
        linear_num_value_heads=3,
        linear_key_head_dim=18,
        linear_value_head_dim=14,
        head_dim=40,
        tie_word_embeddings=True,
    ),
    "dense_hv_hk_2_interval_3": dict(
        moe=False,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        full_attention_interval=3,
        num_hidden_layers=6,
    ),
    "moe_interval_3_tied": dict(
        moe=True, full_attention_interval=3, num_hidden_layers=3, tie_word_embeddings=True
    ),
}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (
        (actual.double() - expected.double()).abs().max() / expected.double().abs().max()
    ).item()


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    hf = make_hf_model(**CASES[request.param])
    path = save_checkpoint(hf, str(tmp_path_factory.mktemp(request.param)))
    return hf, path, CASES[request.param]


@pytest.mark.parametrize("seq_len", SEQ_LENS)
def test_logits_match_transformers(checkpoint, seq_len):
    hf, path, case = checkpoint
    model = load_model(path)
    assert isinstance(model, Qwen3_5MoeForCausalLM if case["moe"] else Qwen3_5ForCausalLM)
    ids = torch.randint(
        0, hf.config.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(seq_len)
    )
    with torch.no_grad():
        expected = hf(ids).logits
    actual = model(ids)
    assert actual.shape == expected.shape
    assert relative_error(actual, expected) < 1e-4


@pytest.mark.parametrize("layout", ["vl", "fused_experts", "sharded"])
@pytest.mark.parametrize("moe", [True, False])
def test_checkpoint_layouts_load_to_same_logits(tmp_path, layout, moe):
    if layout == "fused_experts" and not moe:
        pytest.skip("dense checkpoints have no experts")
    hf = make_hf_model(moe=moe, seed=3)
    path = save_checkpoint(hf, str(tmp_path), layout=layout)
    ids = torch.randint(
        0, hf.config.vocab_size, (1, 65), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        expected = hf(ids).logits
    assert relative_error(load_model(path)(ids), expected) < 1e-4


def test_tied_head_shares_embedding(tmp_path):
    path = save_checkpoint(make_hf_model(moe=True, tie_word_embeddings=True), str(tmp_path))
    model = load_model(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_bfloat16_load_keeps_A_log_fp32_and_tracks_fp32(tmp_path):
    hf = make_hf_model(moe=True, seed=5)
    path = save_checkpoint(hf, str(tmp_path))
    model = load_model(path, dtype=torch.bfloat16)
    gdn = model.model.layers[0].linear_attn
    assert gdn.A_log.dtype == torch.float32 and gdn.out_proj.weight.dtype == torch.bfloat16
    ids = torch.randint(
        0, hf.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        expected = hf(ids).logits
    assert relative_error(model(ids).float(), expected) < 5e-2
