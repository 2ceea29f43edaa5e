"""A block-FP8 checkpoint under tensor and expert parallelism: each rank reads row or column slices of the FP8
tensors that start and end inside 128x128 blocks (and inside the 8x16 blocks of the second case), dequantizes
them with the scales of the blocks they touch, and the TP=2 logits match TP=1's."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_tp_parity import PROMPTS, reference, run_world
from tests.hf_checkpoints import make_hf_model
from tests.models.test_fp8 import make_fp8_checkpoint


@pytest.mark.parametrize("block", [(128, 128), (8, 16)], ids=["block128", "block8x16"])
@pytest.mark.parametrize(
    "layout", [{"tp_size": 2}, {"tp_size": 2, "ep_size": 2}], ids=["tp2", "tp2-ep2"]
)
def test_fp8_checkpoint_tp2_logits_match_tp1(tmp_path, block, layout):
    hf = make_hf_model(moe=True, seed=1, vocab_size=161, shared_expert_intermediate_size=24)
    path = make_fp8_checkpoint(hf, str(tmp_path), "vl", block)
    prompt = PROMPTS[0]
    expected = reference(path, prompt)
    with torch.no_grad():
        assert (
            (expected - hf(torch.tensor([prompt])).logits[0]).abs().max() / expected.abs().max()
        ) < 1e-4
    for logits in run_world(layout, path, [prompt, prompt]):
        torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-4)
