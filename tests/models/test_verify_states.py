"""A speculative verify forward (one row a token, ``build_rows_batch``, with ``ForwardBatch.verify``) against
decoding its tokens one at a time: the same logits at every position, and the Gated DeltaNet states it keeps after
each token are the decode steps' states; restoring one puts exactly those into the request's slot. Through the
modules, and through the CPU's C++ decode blocks (the model in one call)."""

from __future__ import annotations

import pytest
import torch

from sglang_lite.forward_batch import (
    ForwardMode,
    VerifyStates,
    build_forward_batch,
    build_rows_batch,
)
from sglang_lite.kernels import cpu
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.model_executor.decode_blocks import enable_decode_blocks
from sglang_lite.model_executor.weight_layout import store_input_major
from sglang_lite.models.loader import load_model
from tests.hf_checkpoints import make_hf_model, save_checkpoint


@pytest.fixture(scope="module", params=["modules", "blocks"])
def model(request, tmp_path_factory):
    path = save_checkpoint(make_hf_model(moe=True, seed=9), str(tmp_path_factory.mktemp("verify")))
    model = load_model(path)
    if request.param == "blocks":
        cpu.require()
        store_input_major(model)
        assert enable_decode_blocks(model, torch_compile=False) == "on"
    return model


def prefilled(model, prompts: list[list[int]]):
    pools = ModelPools.create(
        model.config, 256, len(prompts), 128, torch.float32, "cpu", page_size=4
    )
    rows = pools.req_to_token.allocator.alloc(len(prompts))
    slots = pools.states.alloc(len(prompts))
    lengths = [len(p) for p in prompts]
    kv = pools.alloc_kv(rows, [0] * len(prompts), lengths)
    batch = build_forward_batch(
        pools, ForwardMode.EXTEND, prompts, [0] * len(prompts), rows, slots, "cpu", kv
    )
    model.forward_batch(batch)
    return pools, rows, slots


def test_verify_matches_decoding_token_by_token(model):
    prompts = [[3, 14, 15, 92, 65, 35], [8, 97, 93]]
    new = [[23, 84, 62, 64], [33, 83]]  # different lengths in one verify forward
    pools, rows, slots = prefilled(model, prompts)
    ref_pools, ref_rows, ref_slots = prefilled(model, prompts)
    starts = [len(p) for p in prompts]
    counts = [len(n) for n in new]
    kv = pools.alloc_kv(rows, starts, counts)
    batch = build_rows_batch(pools, new, starts, rows, slots, "cpu", kv)
    batch.verify = VerifyStates(pools, counts, torch.device("cpu"))
    logits = model.forward_batch(batch)
    offsets = [0, counts[0]]
    for j in range(max(counts)):
        active = [i for i in range(len(new)) if counts[i] > j]
        step_kv = ref_pools.alloc_kv(
            [ref_rows[i] for i in active], [starts[i] + j for i in active], [1] * len(active)
        )
        step = build_forward_batch(
            ref_pools,
            ForwardMode.DECODE,
            [[new[i][j]] for i in active],
            [starts[i] + j for i in active],
            [ref_rows[i] for i in active],
            [ref_slots[i] for i in active],
            "cpu",
            step_kv,
        )
        step_logits = model.forward_batch(step)
        for row, i in enumerate(active):
            torch.testing.assert_close(
                logits[offsets[i] + j], step_logits[row], rtol=1e-4, atol=1e-4
            )
            conv = ref_pools.states.conv_buffer[ref_slots[i]]
            ssm = ref_pools.states.ssm_buffer[ref_slots[i]]
            torch.testing.assert_close(batch.verify.conv[i, j], conv, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(batch.verify.ssm[i, j], ssm, rtol=1e-5, atol=1e-5)
    # the states after the verify's last token are in the slot; restoring after token 1 puts those back
    torch.testing.assert_close(pools.states.ssm_buffer[slots[0]], batch.verify.ssm[0, 3])
    batch.verify.restore(pools, 0, 1, slots[0])
    assert torch.equal(pools.states.ssm_buffer[slots[0]], batch.verify.ssm[0, 1])
    assert torch.equal(pools.states.conv_buffer[slots[0]], batch.verify.conv[0, 1])
    assert not torch.equal(batch.verify.ssm[0, 1], batch.verify.ssm[0, 3])
