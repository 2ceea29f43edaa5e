"""Greedy generation through load_model's cached mode equals transformers generate."""

from __future__ import annotations

import torch

from sglang_lite import load_model
from sglang_lite.generate import greedy_generate
from tests.hf_checkpoints import make_hf_model, save_checkpoint


def test_greedy_generate_matches_transformers(tmp_path):
    hf = make_hf_model(moe=True, seed=11)
    model = load_model(save_checkpoint(hf, str(tmp_path)))
    prompt = torch.randint(
        0, hf.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        # an explicit mask: generate would otherwise treat any prompt token equal to pad_token_id as padding
        expected = hf.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False
        )
    assert greedy_generate(model, prompt[0].tolist(), 12) == expected[0, 21:].tolist()
