"""MXFP4 weights kept packed under tensor parallelism: shards that cover whole 32-groups give TP1's logits; a shard
that cuts a group is refused, naming the tensor."""

from __future__ import annotations

import torch

from sglang_lite.models.loader import load_model
from tests.distributed.test_fp8_tp import run_fp8_world
from tests.distributed.test_tp_parity import PROMPTS
from tests.hf_checkpoints import make_hf_model
from tests.models.test_mxfp4 import export

# every input dimension a row-parallel shard cuts (o_proj 128, expert down 64, shared down 64) halves into 32-groups
WHOLE_GROUPS = dict(
    moe=True,
    seed=1,
    hidden_size=64,
    head_dim=32,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
)


def test_mxfp4_tp2_matches_tp1_when_shards_cover_whole_groups(tmp_path):
    path = export(make_hf_model(**WHOLE_GROUPS), str(tmp_path))
    prompt = PROMPTS[0]
    expected = load_model(path, quantized_weights=True)(torch.tensor([prompt]))[0]
    for logits in run_fp8_world({"tp_size": 2}, path, prompt):
        assert not isinstance(logits, str), logits
        torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-4)


def test_mxfp4_tp2_refuses_shards_that_cut_a_group(tmp_path):
    path = export(make_hf_model(moe=True, seed=1), str(tmp_path))
    errors = run_fp8_world({"tp_size": 2}, path, PROMPTS[0])
    for rank, error in enumerate(errors):
        assert isinstance(error, str) and "CheckpointError" in error, error
        columns = "0:12" if rank == 0 else "12:24"
        assert "tensor 'model.layers.0.mlp.experts.0.down_proj.weight' (48, 24)" in error, error
        assert "loads as MXFP4 in 1x32 blocks" in error
        assert f"columns {columns}: shard size (48, 12))" in error, error
