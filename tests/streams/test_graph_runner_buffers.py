"""The CUDA-graph runner's static-buffer path, run eagerly on the CPU: padded decode equals plain decode."""

from __future__ import annotations

import pytest
import torch

from sglang_lite import load_model
from sglang_lite.forward_batch import ForwardMode, build_forward_batch
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.model_executor import CudaGraphRunner, capture_batch_sizes
from tests.hf_checkpoints import make_hf_model, save_checkpoint


def test_capture_sizes():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(6) == [1, 2, 4, 6]
    assert capture_batch_sizes(24) == [1, 2, 4, 8, 16, 24]
    assert capture_batch_sizes(30) == [1, 2, 4, 8, 16, 24, 30]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(
        save_checkpoint(make_hf_model(moe=True, seed=4), str(tmp_path_factory.mktemp("m")))
    )


def run_session(model, step):
    """Prefill 5 requests of different lengths, then 3 decode steps of 5, 3 and 1 requests via ``step``."""
    pools = ModelPools.create(model.config, 400, 8, 64, torch.float32, "cpu")
    rows, slots = pools.req_to_token.allocator.alloc(5), pools.states.alloc(5)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 160, (n,), generator=gen).tolist() for n in (3, 17, 8, 30, 1)]
    cached = [0] * 5
    build = lambda mode, which, toks: build_forward_batch(  # noqa: E731
        pools,
        mode,
        toks,
        [cached[i] for i in which],
        [rows[i] for i in which],
        [slots[i] for i in which],
        "cpu",
        pools.alloc_kv(
            [rows[i] for i in which], [cached[i] for i in which], [len(t) for t in toks]
        ),
    )
    model.forward_batch(build(ForwardMode.EXTEND, range(5), prompts))
    cached = [len(p) for p in prompts]
    outputs = []
    for which in ([0, 1, 2, 3, 4], [1, 3, 4], [2]):
        batch = build(ForwardMode.DECODE, which, [[7 + i] for i in which])
        outputs.append(step(batch, pools).clone())
        for i in which:
            cached[i] += 1
    return outputs


def test_padded_static_decode_equals_eager_decode(model):
    eager = run_session(model, lambda batch, pools: model.forward_batch(batch))
    runners = {}

    def replay(batch, pools):
        runner = runners.setdefault(
            id(pools), CudaGraphRunner(model, pools, max_bs=8, use_graphs=False)
        )
        assert runner.can_run(batch)
        return runner.replay(batch)

    padded = run_session(model, replay)
    for a, b in zip(eager, padded):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)
