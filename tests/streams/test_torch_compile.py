"""--enable-torch-compile: decode steps through torch.compile give the eager logits (CPU), as one graph."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from sglang_lite import load_model
from sglang_lite.forward_batch import ForwardMode, build_forward_batch
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.model_executor import ModelRunner
from sglang_lite.server_args import ServerArgs


def decode_logits(model, forward, batch_size: int, steps: int) -> list[torch.Tensor]:
    pools = ModelPools.create(model.config, batch_size * 64, batch_size, 64, torch.float32, "cpu")
    rows, slots = pools.req_to_token.allocator.alloc(batch_size), pools.states.alloc(batch_size)
    prompts = [[(7 * r + 3 * i) % 4000 + 1 for i in range(5 + r)] for r in range(batch_size)]
    model.forward_batch(
        build_forward_batch(
            pools,
            ForwardMode.EXTEND,
            prompts,
            [0] * batch_size,
            rows,
            slots,
            "cpu",
            pools.alloc_kv(rows, [0] * batch_size, [len(p) for p in prompts]),
        )
    )
    cached, out = [len(p) for p in prompts], []
    for step in range(steps):
        batch = build_forward_batch(
            pools,
            ForwardMode.DECODE,
            [[11 + step]] * batch_size,
            cached,
            rows,
            slots,
            "cpu",
            pools.alloc_kv(rows, cached, [1] * batch_size),
        )
        out.append(forward(batch).clone())
        cached = [c + 1 for c in cached]
    return out


def test_compiled_decode_equals_eager():
    model = load_model(None)
    runner = ModelRunner(model, pools=None, args=ServerArgs(enable_torch_compile=True))
    assert runner.compiled_body is not None
    counters.clear()
    for batch_size in (
        3,
        5,
    ):  # the second size must reuse the dynamic graph or recompile, not go wrong
        eager = decode_logits(model, model.forward_batch, batch_size, 3)
        compiled = decode_logits(model, runner.forward_batch, batch_size, 3)
        for a, b in zip(eager, compiled):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    # no host read in the decode body (seq_lens.max() once broke the graph at the attention layer)
    assert not counters["graph_break"], dict(counters["graph_break"])
