"""Speculation's forwards through the CPU's C++ decode blocks compute what the modules compute: the verify forward
(one row a token, the Gated DeltaNet layers stepping each request's tokens in order in one C++ call, keeping the
states after each) and the MTP head over rows (its input and its decoder layer as C++ calls), for requests
verifying different numbers of tokens, dense and MoE models."""

from __future__ import annotations

import itertools

import pytest
import torch

from sglang_lite import load_model
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
from tests.kernels.utils import assert_rel_close

PROMPT_LENS = [5, 1, 23]
VERIFY_COUNTS = [4, 1, 3]  # a request's last token and its drafts; one without drafts (a grammar's)


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    cpu.require()


def _model(path: str, blocks: bool) -> torch.nn.Module:
    model = load_model(path, with_mtp=True)
    store_input_major(model)
    if blocks:
        assert enable_decode_blocks(model, torch_compile=False) == "on"
    assert model.mtp.use_decode_blocks == blocks
    return model


def _verify_then_head(model: torch.nn.Module, page_size: int):
    """Prefill of three prompts, a verify forward of VERIFY_COUNTS tokens each, then the head over those rows:
    (verify hidden states, the states kept after each token, the head's output, the pools)."""
    config = model.config
    pools = ModelPools.create(
        config, 256, 4, 64, torch.float32, "cpu", page_size=page_size, draft_layers=1
    )
    rows, slots = pools.req_to_token.allocator.alloc(3), pools.states.alloc(3)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS
    ]
    zeros = [0, 0, 0]
    prefill = build_forward_batch(
        pools, ForwardMode.EXTEND, prompts, zeros, rows, slots, "cpu",
        pools.alloc_kv(rows, zeros, PROMPT_LENS),
    )  # fmt: skip
    model.forward_batch(prefill)
    drafts = [
        torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in VERIFY_COUNTS
    ]
    kv = pools.alloc_kv(rows, PROMPT_LENS, VERIFY_COUNTS)
    batch = build_rows_batch(pools, drafts, PROMPT_LENS, rows, slots, "cpu", kv)
    batch.verify = VerifyStates(pools, VERIFY_COUNTS, torch.device("cpu"))
    with torch.inference_mode():
        hidden = model.forward_hidden(batch)
        following = torch.randint(0, config.vocab_size, (sum(VERIFY_COUNTS),), generator=gen)
        ends = list(itertools.accumulate(VERIFY_COUNTS))
        tokens = [following[end - n : end].tolist() for n, end in zip(VERIFY_COUNTS, ends)]
        head_batch = build_rows_batch(pools, tokens, PROMPT_LENS, rows, slots, "cpu", kv)
        head = model.mtp(head_batch, hidden)
    return hidden, batch.verify, head, pools


@pytest.mark.parametrize("kind", ["moe", "dense"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_verify_and_head_blocks_match_the_modules(spec_checkpoints, kind, page_size):
    path = spec_checkpoints[(kind, "random")]
    want = _verify_then_head(_model(path, blocks=False), page_size)
    got = _verify_then_head(_model(path, blocks=True), page_size)
    assert_rel_close(got[0], want[0], torch.float32, "verify hidden states")
    for name in ("conv", "ssm"):  # the states after each verified token (only those a request has)
        for i, n in enumerate(VERIFY_COUNTS):
            g, w = getattr(got[1], name)[i, :n], getattr(want[1], name)[i, :n]
            assert_rel_close(g, w, torch.float32, f"{name} states of request {i}")
    assert_rel_close(got[2], want[2], torch.float32, "the head's hidden states")
    got_pools, want_pools = got[3], want[3]
    for name in ("conv_buffer", "ssm_buffer"):
        assert_rel_close(
            getattr(got_pools.states, name), getattr(want_pools.states, name), torch.float32, name
        )
    # keys and values of the model's layers and of the head's layer
    assert_rel_close(got_pools.kv.buffer, want_pools.kv.buffer, torch.float32, "KV")
