"""Storing the projection weights [in, out] for the CPU's GEMMs changes no logit, tied embeddings included."""

from __future__ import annotations

import pytest
import torch

from sglang_lite import load_model
from sglang_lite.model_executor.weight_layout import store_input_major
from tests.hf_checkpoints import make_hf_model, save_checkpoint


@pytest.mark.parametrize("moe,tied", [(True, False), (False, True)], ids=["moe", "dense-tied"])
def test_input_major_weights_give_the_same_logits(tmp_path, moe, tied):
    hf = make_hf_model(moe=moe, seed=3, tie_word_embeddings=tied)
    model = load_model(save_checkpoint(hf, str(tmp_path)))
    ids = torch.randint(
        0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0)
    )
    before = model(ids)
    assert store_input_major(model) > 0
    torch.testing.assert_close(model(ids), before, rtol=1e-5, atol=1e-5)
    # a tied LM head is the embedding, which looks up rows: it keeps its row-major layout
    assert model.lm_head.weight.is_contiguous() == tied
    assert model.model.embed_tokens.weight.is_contiguous()
