"""The cached, packed variable-length mode equals the plain causal forward."""

from __future__ import annotations

import pytest
import torch

from sglang_lite import load_model
from sglang_lite.forward_batch import ForwardMode, build_forward_batch
from sglang_lite.mem_cache.pools import ModelPools
from tests.hf_checkpoints import make_hf_model, save_checkpoint


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


@pytest.fixture(scope="module", params=[True, False], ids=["moe", "dense"])
def model(request, tmp_path_factory):
    hf = make_hf_model(moe=request.param, seed=7, linear_num_key_heads=1, linear_num_value_heads=2)
    return load_model(save_checkpoint(hf, str(tmp_path_factory.mktemp("ckpt"))))


class Session:
    """Drives the cached mode the way an engine does: request rows, state slots, chunks, decode steps."""

    def __init__(self, model, num_requests: int, max_len: int) -> None:
        self.model = model
        num_slots = num_requests * max_len
        self.pools = ModelPools.create(
            model.config, num_slots, num_requests, max_len, torch.float32, "cpu"
        )
        self.rows = self.pools.req_to_token.allocator.alloc(num_requests)
        self.slots = self.pools.states.alloc(num_requests)
        self.cached = [0] * num_requests

    def run(
        self, which: list[int], tokens: list[list[int]], mode: ForwardMode, all_logits: bool
    ) -> torch.Tensor:
        batch = build_forward_batch(
            self.pools,
            mode,
            tokens,
            [self.cached[i] for i in which],
            [self.rows[i] for i in which],
            [self.slots[i] for i in which],
            "cpu",
            self.pools.alloc_kv(
                [self.rows[i] for i in which],
                [self.cached[i] for i in which],
                [len(t) for t in tokens],
            ),
        )
        for i, t in zip(which, tokens):
            self.cached[i] += len(t)
        return self.model.forward_batch(batch, all_logits=all_logits)


def test_packed_batch_equals_each_request_alone(model):
    lengths = [1, 63, 64, 65, 17]
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths
    ]
    packed = Session(model, len(prompts), 80).run(
        list(range(len(prompts))), prompts, ForwardMode.EXTEND, True
    )
    start = 0
    for prompt in prompts:
        alone = model(torch.tensor([prompt]))[0]
        assert rel(packed[start : start + len(prompt)], alone) < 1e-4
        start += len(prompt)


@pytest.mark.parametrize("chunks", [[40, 25], [10, 30, 24]])
def test_chunked_prefill_then_decode_equals_full_forward(model, chunks):
    """Requests of different lengths prefill in chunks (continuing from cached state), then decode together."""
    num_decode = 6
    gen = torch.Generator().manual_seed(len(chunks))
    prompt_lens = [sum(chunks), sum(chunks) - 7]
    full = [
        torch.randint(0, model.config.vocab_size, (n + num_decode,), generator=gen).tolist()
        for n in prompt_lens
    ]
    expected = [model(torch.tensor([seq]))[0] for seq in full]
    session = Session(model, 2, 128)
    for r, n in enumerate(prompt_lens):
        done = 0
        for size in chunks:
            size = min(size, n - done)
            logits = session.run([r], [full[r][done : done + size]], ForwardMode.EXTEND, True)
            assert rel(logits, expected[r][done : done + size]) < 1e-4
            done += size
    for step in range(num_decode):
        tokens = [[full[r][n + step]] for r, n in enumerate(prompt_lens)]
        logits = session.run([0, 1], tokens, ForwardMode.DECODE, False)
        for r, n in enumerate(prompt_lens):
            assert rel(logits[r], expected[r][n + step]) < 1e-4


def test_decode_rejects_multi_token_requests(model):
    session = Session(model, 1, 8)
    with pytest.raises(AssertionError, match="decode takes 1 token"):
        session.run([0], [[1, 2]], ForwardMode.DECODE, False)
