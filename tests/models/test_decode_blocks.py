"""Decode steps on the CPU as one C++ call per block, or one for the whole model (``model_executor/decode_blocks.py``),
compute what the modules compute: the same logits every step and the same pools after it, for GDN and attention
layers, MoE blocks with a fused or a separate shared expert and dense MLPs, float32, bf16 and FP8 weights, requests
of different lengths."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from sglang_lite import load_model
from sglang_lite.forward_batch import ForwardMode, build_forward_batch
from sglang_lite.kernels import cpu
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.model_executor.decode_blocks import enable_decode_blocks
from sglang_lite.model_executor.weight_layout import store_input_major
from sglang_lite.models import qwen3_5
from tests.hf_checkpoints import make_hf_model, save_checkpoint
from tests.kernels.utils import assert_rel_close

PROMPT_LENS = [5, 1, 23]
STEPS = 4
FP8_SHAPE = dict(  # every packed projection on 128-row blocks, so that each stays FP8
    hidden_size=256,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
    vocab_size=300,
)


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    cpu.require()


def _model(path: str, blocks: bool, **load) -> torch.nn.Module:
    """The model as the runner prepares it on the CPU, with or without the decode blocks."""
    model = load_model(path, **load)
    store_input_major(model)
    if blocks:
        assert enable_decode_blocks(model, torch_compile=False) == "on"
    return model


def _run(
    model: torch.nn.Module, page_size: int, prompt_lens: list[int] = PROMPT_LENS
) -> tuple[list[torch.Tensor], ModelPools]:
    """Prefill of three prompts (or of ``prompt_lens``), then STEPS decode steps of them (greedy); every step's
    logits."""
    config = model.config
    requests = len(prompt_lens)
    pools = ModelPools.create(config, 256, 4, 64, model.compute_dtype, "cpu", page_size=page_size)
    rows, slots = pools.req_to_token.allocator.alloc(requests), pools.states.alloc(requests)
    gen = torch.Generator().manual_seed(0)
    tokens = [
        torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in prompt_lens
    ]
    lens, mode = [0] * requests, ForwardMode.EXTEND
    steps = []
    for _ in range(STEPS + 1):
        counts = [len(t) for t in tokens]
        batch = build_forward_batch(
            pools, mode, tokens, lens, rows, slots, "cpu", pools.alloc_kv(rows, lens, counts)
        )
        logits = model.forward_batch(batch)
        steps.append(logits)
        lens = [n + c for n, c in zip(lens, counts)]
        tokens, mode = [[int(t)] for t in logits.argmax(-1)], ForwardMode.DECODE
    return steps, pools


def _assert_same_steps(path: str, page_size: int = 1, **load) -> None:
    want, want_pools = _run(_model(path, blocks=False, **load), page_size)
    got, got_pools = _run(_model(path, blocks=True, **load), page_size)
    for step, (g, w) in enumerate(zip(got, want)):
        assert_rel_close(g, w, torch.float32, f"logits of step {step}")
    for name in ("conv_states", "ssm_states"):
        for g, w in zip(getattr(got_pools.states, name), getattr(want_pools.states, name)):
            assert_rel_close(g, w, torch.float32, name)
    for g, w in zip(got_pools.kv.k_buffers, want_pools.kv.k_buffers):
        assert_rel_close(g, w, torch.float32, "keys")


@pytest.mark.parametrize(
    "kind, overrides, fused_shared",
    [
        ("moe", {}, False),  # shared expert of another width: beside the experts
        ("moe", dict(moe_intermediate_size=16), True),  # the same width: one more expert
        ("dense", dict(tie_word_embeddings=True), False),
    ],
    ids=["moe-separate-shared", "moe-fused-shared", "dense-tied"],
)
@pytest.mark.parametrize("weights", ["float32", "bf16"])
@pytest.mark.parametrize(
    "page_size", [1, 16]
)  # the attention block reads keys through the page table
def test_decode_blocks_match_the_modules(
    tmp_path, monkeypatch, kind, overrides, fused_shared, weights, page_size
):
    monkeypatch.setenv("SGLANG_CPU_BF16_DOT", "widen")  # the same products both ways, bf16 too
    hf = make_hf_model(moe=kind == "moe", seed=2, **overrides)
    path = save_checkpoint(hf, str(tmp_path))
    load = dict(weight_dtype=torch.bfloat16 if weights == "bf16" else None)
    mlp = _model(path, blocks=False, **load).model.layers[0].mlp
    assert getattr(mlp, "fuse_shared_expert", False) == fused_shared
    _assert_same_steps(path, page_size, **load)


def _chunked_prefill(model: torch.nn.Module) -> tuple[list[torch.Tensor], ModelPools]:
    """Two prompts prefilled in two chunks each (the second continuing from the states the first left); each
    chunk's logits."""
    config = model.config
    pools = ModelPools.create(config, 256, 4, 64, model.compute_dtype, "cpu")
    rows, slots = pools.req_to_token.allocator.alloc(2), pools.states.alloc(2)
    gen = torch.Generator().manual_seed(1)
    chunks = [[7, 30], [19, 2]]  # tokens of each request per chunk
    lens, out = [0, 0], []
    for counts in chunks:
        tokens = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in counts]
        kv = pools.alloc_kv(rows, lens, counts)
        batch = build_forward_batch(pools, ForwardMode.EXTEND, tokens, lens, rows, slots, "cpu", kv)
        out.append(model.forward_batch(batch))
        lens = [n + c for n, c in zip(lens, counts)]
    return out, pools


@pytest.mark.parametrize("weights, most_tokens", [("float32", None), ("bf16", None), ("bf16", 25)])
def test_prefill_blocks_continue_a_chunked_prefill(tmp_path, monkeypatch, weights, most_tokens):
    """With the blocks on, a prefill's layers run as their C++ blocks over the requests' tokens (the mixers from
    the input norm on, every MLP half): a chunk that continues a prompt starts from the states and keys the last one
    left, and computes what the modules compute. A forward of more tokens than the blocks take runs the modules
    (``most_tokens``: the first chunk's 37 tokens then, the second's 21 through the blocks)."""
    monkeypatch.setenv("SGLANG_CPU_BF16_DOT", "widen")
    if most_tokens is not None:
        monkeypatch.setattr(qwen3_5, "MOE_CHUNK_TOKENS", most_tokens)
    path = save_checkpoint(make_hf_model(moe=True, seed=4), str(tmp_path))
    load = dict(weight_dtype=torch.bfloat16 if weights == "bf16" else None)
    model = _model(path, blocks=True, **load)
    calls = []
    monkeypatch.setattr(cpu, "gdn_decode_block", _counting(cpu.gdn_decode_block, calls))
    got, got_pools = _chunked_prefill(model)
    gdn_layers = sum(layer.mixer_name == "linear_attn" for layer in model.model.layers)
    chunks_in_blocks = 2 if most_tokens is None else 1
    assert len(calls) == chunks_in_blocks * gdn_layers
    assert all(c is not None for c in calls)  # cu_seqlens: prefills
    want, want_pools = _chunked_prefill(_model(path, blocks=False, **load))
    for chunk, (g, w) in enumerate(zip(got, want)):
        assert_rel_close(g, w, torch.float32, f"logits of chunk {chunk}")
    for name in ("conv_states", "ssm_states"):
        for g, w in zip(getattr(got_pools.states, name), getattr(want_pools.states, name)):
            assert_rel_close(g, w, torch.float32, name)


def _counting(fn, calls: list):
    """``fn`` that records each call's ``cu_seqlens`` (its last argument, None for a decode step)."""

    def counted(*args):
        calls.append(args[-1])
        return fn(*args)

    return counted


def test_whole_model_in_one_call_equals_a_call_per_block(tmp_path, monkeypatch):
    """One rank runs every layer's blocks in one C++ call (``Qwen3_5Model.decode_layers``), built for the pools
    it is given (again for new ones): the same kernels as a call per block (the path of tensor parallelism, which
    reduces between the blocks), so the same logits and pools exactly."""
    path = save_checkpoint(make_hf_model(moe=True, seed=3), str(tmp_path))
    model = _model(path, blocks=True, weight_dtype=torch.bfloat16)
    inner = model.model
    got, got_pools = _run(model, page_size=16)
    assert inner._decode_layers.built[0] is got_pools
    assert len(inner._decode_layers.built[1]) == 2 * len(inner.layers)
    again, again_pools = _run(model, page_size=16)
    assert inner._decode_layers.built[0] is again_pools
    monkeypatch.setattr(type(inner), "decode_layers", lambda self, pools: None)
    want, want_pools = _run(model, page_size=16)
    for step, (g, a, w) in enumerate(zip(got, again, want)):
        assert torch.equal(g, w) and torch.equal(a, w), f"logits of step {step}"
    for name in ("conv_buffer", "ssm_buffer"):
        assert torch.equal(getattr(got_pools.states, name), getattr(want_pools.states, name)), name
    assert torch.equal(got_pools.kv.buffer, want_pools.kv.buffer)


def test_decode_blocks_with_fp8_weights(tmp_path):
    """Online FP8 keeps every aligned projection FP8 (routers and in_proj_ba stay high precision)."""
    hf = make_hf_model(moe=True, seed=4, **FP8_SHAPE)
    path = save_checkpoint(hf, str(tmp_path))
    load = dict(quantization="fp8", quantized_weights=True, misaligned="dequantize")
    model = _model(path, blocks=False, **load)
    assert model.model.layers[0].mlp.experts.w13.dtype == torch.float8_e4m3fn
    assert model.model.layers[0].linear_attn.in_proj_qkvz.weight.dtype == torch.float8_e4m3fn
    _assert_same_steps(path, **load)


def test_decode_blocks_say_why_they_stay_off(tmp_path):
    path = save_checkpoint(make_hf_model(moe=True, seed=1), str(tmp_path))
    model = load_model(path)
    assert enable_decode_blocks(model, torch_compile=True).startswith("off (torch.compile")
    bf16_model = load_model(path, dtype=torch.bfloat16)
    assert "activations in torch.bfloat16" in enable_decode_blocks(bf16_model, torch_compile=False)
    assert not bf16_model.model.use_decode_blocks


@pytest.mark.parametrize(
    "kind, overrides",
    [("moe", {}), ("dense", dict(tie_word_embeddings=True))],
    ids=["moe", "dense-tied"],
)
def test_one_call_from_token_ids_to_logits(tmp_path, monkeypatch, kind, overrides):
    """A decode step's embedding (bf16 rows widened), final norm and LM head join the one call
    (``Qwen3_5Model.decode_logits``): the same logits and pools, bitwise, as the one call's layers between those
    three through the modules."""
    hf = make_hf_model(moe=kind == "moe", seed=5, **overrides)
    path = save_checkpoint(hf, str(tmp_path))
    model = _model(path, blocks=True, weight_dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    calls = []
    real = cpu.DecodeLayers.run_logits
    monkeypatch.setattr(
        cpu.DecodeLayers, "run_logits", lambda self, *a: calls.append(1) or real(self, *a)
    )
    got, got_pools = _run(model, page_size=16)
    assert len(calls) == STEPS
    monkeypatch.setattr(type(model.model), "decode_logits", lambda self, batch: None)
    want, want_pools = _run(model, page_size=16)
    assert len(calls) == STEPS
    for step, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"logits of step {step}"
    for name in ("conv_buffer", "ssm_buffer"):
        assert torch.equal(getattr(got_pools.states, name), getattr(want_pools.states, name)), name
    assert torch.equal(got_pools.kv.buffer, want_pools.kv.buffer)


def test_one_call_ends_are_checked():
    layers = cpu.DecodeLayers()
    with pytest.raises(RuntimeError, match="needs set_ends first"):
        layers.run_logits(*(torch.zeros(1, dtype=torch.int64),) * 2, (torch.zeros(1),) * 4, 1)
    with pytest.raises(RuntimeError, match="final norm"):
        layers.set_ends(
            torch.zeros(10, 8), cpu.Norm(torch.zeros(4), 1e-6), cpu.Weight(torch.zeros(10, 8))
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_names_a_token_outside_the_vocabulary(dtype):
    """The one call reads the embedding's rows itself: a token id outside it is one error naming the id, before
    any layer runs."""
    layers = cpu.DecodeLayers()
    layers.set_ends(
        torch.zeros(10, 8, dtype=dtype),
        cpu.Norm(torch.zeros(8), 1e-6),
        cpu.Weight(torch.zeros(10, 8)),
    )
    requests = (torch.zeros(2, dtype=torch.int64),) * 4
    for bad in (10, -1):
        ids = torch.tensor([3, bad])
        with pytest.raises(
            RuntimeError, match=rf"input_ids\[1\] = {bad} is outside the vocabulary of 10"
        ):
            layers.run_logits(ids, torch.zeros(2, dtype=torch.int64), requests, 1)
    with pytest.raises(RuntimeError, match="holds no blocks"):  # good ids reach the layers
        layers.run_logits(torch.tensor([3, 9]), torch.zeros(2, dtype=torch.int64), requests, 1)


def _greedy_run(model: torch.nn.Module, stop_at: tuple[int, int] | None = None, wake_fd: int = -1):
    """``_run``'s prefill, then its STEPS greedy decode steps in one ``decode_greedy`` call (KV slots for every step
    allocated first); with ``stop_at`` (step, request), that request's token of that step is its stop id. The
    tokens [steps run, 3], the pools, and each request's keys of the first attention layer in position order."""
    config = model.config
    pools = ModelPools.create(config, 256, 4, 64, model.compute_dtype, "cpu", page_size=16)
    rows, slots = pools.req_to_token.allocator.alloc(3), pools.states.alloc(3)
    gen = torch.Generator().manual_seed(0)
    tokens = [
        torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS
    ]
    lens = [0, 0, 0]
    prefill = build_forward_batch(
        pools, ForwardMode.EXTEND, tokens, lens, rows, slots, "cpu",
        pools.alloc_kv(rows, lens, PROMPT_LENS),
    )  # fmt: skip
    first = [[int(t)] for t in model.forward_batch(prefill).argmax(-1)]
    kv = pools.alloc_kv(rows, PROMPT_LENS, [STEPS] * 3)  # request after request
    out_cache_loc = torch.tensor(kv).view(3, STEPS).t().contiguous()
    batch = build_forward_batch(
        pools, ForwardMode.DECODE, first, PROMPT_LENS, rows, slots, "cpu", out_cache_loc[0].tolist()
    )
    stop_ids = torch.full((3, 1), -1, dtype=torch.int64)
    if stop_at is not None:
        step, request = stop_at
        stop_ids[request, 0] = _greedy_run(model)[0][step, request]
    got = model.model.decode_greedy(batch, out_cache_loc, stop_ids, wake_fd)
    keys = [
        pools.kv.k_buffers[0][pools.req_to_token.slots(row, 0, n + len(got))]
        for row, n in zip(rows, PROMPT_LENS)
    ]
    return got, pools, (rows, keys)


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_greedy_steps_in_one_call_equal_a_call_a_step(tmp_path, kind):
    """``decode_greedy`` (``DecodeLayers.run_greedy``: the steps of ``--num-continuous-decode-steps`` in one call)
    takes each step's argmax as the next step's input: the tokens, states and keys of STEPS ``decode_logits`` steps,
    bitwise; a run ends after the step that produced a stop id."""
    hf = make_hf_model(moe=kind == "moe", seed=6)
    model = _model(save_checkpoint(hf, str(tmp_path)), blocks=True, weight_dtype=torch.bfloat16)
    want_logits, want_pools = _run(model, page_size=16)
    want = torch.stack([logits.argmax(-1) for logits in want_logits[1:]])
    got, got_pools, (rows, keys) = _greedy_run(model)
    assert got.shape == (STEPS, 3) and torch.equal(got, want)
    for name in ("conv_buffer", "ssm_buffer"):
        assert torch.equal(getattr(got_pools.states, name), getattr(want_pools.states, name)), name
    want_keys = [
        want_pools.kv.k_buffers[0][want_pools.req_to_token.slots(row, 0, n + STEPS)]
        for row, n in zip(rows, PROMPT_LENS)
    ]  # both runs took the same rows of fresh pools
    assert all(torch.equal(g, w) for g, w in zip(keys, want_keys))
    stopped, _, _ = _greedy_run(model, stop_at=(1, 2))
    assert torch.equal(stopped, want[:2])
    # the scheduler's inbox as a pipe: while it has nothing to read the run goes on; once it has (a command
    # arrived), the run ends after the step in which it is found
    read_end, write_end = os.pipe()
    try:
        quiet, _, _ = _greedy_run(model, wake_fd=read_end)
        assert torch.equal(quiet, want)
        os.write(write_end, b"x")
        woken, _, _ = _greedy_run(model, wake_fd=read_end)
        assert torch.equal(woken, want[:1])
    finally:
        os.close(read_end)
        os.close(write_end)
    ids = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="stop_ids"):  # [S], not [B, S]
        cpu.DecodeLayers().run_greedy(ids, ids, (ids,) * 3, ids.view(1, 1), ids, 1)


def _greedy_one(model: torch.nn.Module, steps: int, greedy_head: bool, monkeypatch) -> torch.Tensor:
    """One request's prefill, then ``steps`` greedy decode steps in one ``decode_greedy`` call (batch 1), with the
    LM head's screen (``csrc/greedy_head.h``) on or off: the tokens [steps]."""
    monkeypatch.setenv("SGLANG_CPU_GREEDY_HEAD", "1" if greedy_head else "0")
    model.model.reset_decode_layers()  # a screen is built on first use: none carried between the runs
    config = model.config
    pools = ModelPools.create(config, 256, 2, 64, model.compute_dtype, "cpu", page_size=16)
    rows, slots = pools.req_to_token.allocator.alloc(1), pools.states.alloc(1)
    prompt = torch.randint(0, config.vocab_size, (7,), generator=torch.Generator().manual_seed(3))
    prefill = build_forward_batch(
        pools, ForwardMode.EXTEND, [prompt.tolist()], [0], rows, slots, "cpu",
        pools.alloc_kv(rows, [0], [7]),
    )  # fmt: skip
    first = int(model.forward_batch(prefill).argmax(-1))
    out_cache_loc = torch.tensor(pools.alloc_kv(rows, [7], [steps])).view(steps, 1)
    batch = build_forward_batch(
        pools, ForwardMode.DECODE, [[first]], [7], rows, slots, "cpu", out_cache_loc[0].tolist()
    )
    stop_ids = torch.full((1, 1), -1, dtype=torch.int64)
    return model.model.decode_greedy(batch, out_cache_loc, stop_ids)[:, 0]


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_greedy_head_at_batch_1_gives_the_whole_heads_tokens(tmp_path, monkeypatch, weight_dtype):
    """At batch 1 the one call finds each step's token through the LM head's int8 screen: the tokens of the whole
    head's argmax, for a bf16 and a float32 head; and where two rows of the head are equal at the top, the whole
    head's first of them (the screen cannot separate them and reads the whole head)."""
    steps = 12
    hf = make_hf_model(moe=True, seed=11)
    path = save_checkpoint(hf, str(tmp_path))
    model = _model(path, blocks=True, weight_dtype=weight_dtype)
    whole = _greedy_one(model, steps, False, monkeypatch)
    assert torch.equal(_greedy_one(model, steps, True, monkeypatch), whole)
    # the first step's token's row of the head copied to another index: the lower of the two wins the tie
    head = model.lm_head.weight
    top = int(whole[0])
    other = 0 if top != 0 else 1
    with torch.no_grad():
        head[other] = head[top]
    tied = _greedy_one(model, steps, False, monkeypatch)
    assert int(tied[0]) == min(other, top)
    assert torch.equal(_greedy_one(model, steps, True, monkeypatch), tied)


def _prefill(model: torch.nn.Module, lens: list[int]):
    """A prefill batch of random prompts of ``lens`` tokens over pools of its own."""
    config = model.config
    pools = ModelPools.create(config, 256, 4, 64, model.compute_dtype, "cpu", page_size=16)
    rows, slots = pools.req_to_token.allocator.alloc(len(lens)), pools.states.alloc(len(lens))
    gen = torch.Generator().manual_seed(sum(lens))
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in lens]
    zeros = [0] * len(lens)
    return build_forward_batch(
        pools,
        ForwardMode.EXTEND,
        prompts,
        zeros,
        rows,
        slots,
        "cpu",
        pools.alloc_kv(rows, zeros, lens),
    )


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_a_prefills_argmaxes_through_the_head_are_its_logits_argmaxes(
    tmp_path, monkeypatch, weight_dtype
):
    """``extend_greedy``: each request's argmax after a prefill of one and of three prompts, through the one call's
    LM head with its screen and without, is the argmax of ``forward_batch``'s logits; a decode batch, or a model
    without the decode blocks, has no such path (None)."""
    hf = make_hf_model(moe=True, seed=11)
    path = save_checkpoint(hf, str(tmp_path))
    model = _model(path, blocks=True, weight_dtype=weight_dtype)
    for lens in ([7], PROMPT_LENS):
        want = model.forward_batch(_prefill(model, lens)).argmax(-1)
        for greedy_head in ("1", "0"):
            monkeypatch.setenv("SGLANG_CPU_GREEDY_HEAD", greedy_head)
            model.model.reset_decode_layers()
            assert torch.equal(model.extend_greedy(_prefill(model, lens)), want)
    assert (
        model.extend_greedy(dataclasses.replace(_prefill(model, [1, 1]), mode=ForwardMode.DECODE))
        is None
    )
    assert (
        _model(path, blocks=False, weight_dtype=weight_dtype).extend_greedy(_prefill(model, [7]))
        is None
    )


def _one_request_steps(
    model: torch.nn.Module, planes: bool, monkeypatch
) -> tuple[list[torch.Tensor], int]:
    """One request's prefill and STEPS decode steps at batch 1 through the one call, with the bf16 projections'
    12-bit planes kept or not (``SGLANG_CPU_BF16_PLANES``): every step's logits, and the planes' bytes."""
    monkeypatch.setenv("SGLANG_CPU_BF16_PLANES", "1" if planes else "0")
    model.model.reset_decode_layers()
    steps, pools = _run(model, 16, prompt_lens=[9])
    return steps, model.model.decode_layers(pools).bf16_planes_bytes


def test_bf16_planes_give_the_bf16_weights_logits(tmp_path, monkeypatch):
    """Decode steps at batch 1 reading the Gated DeltaNet projections' 12-bit planes (csrc/bf16_planes.h) give the
    logits of the bf16 weights themselves, bit for bit; the planes are kept only where asked for."""
    monkeypatch.setenv("SGLANG_CPU_BF16_DOT", "widen")
    hf = make_hf_model(
        moe=True, seed=12, hidden_size=128, linear_key_head_dim=32, linear_value_head_dim=32
    )  # projections of 128 columns and more, read split over K
    path = save_checkpoint(hf, str(tmp_path))
    model = _model(path, blocks=True, weight_dtype=torch.bfloat16)
    with_planes, kept = _one_request_steps(model, True, monkeypatch)
    without, none = _one_request_steps(model, False, monkeypatch)
    assert kept > 0 and none == 0
    for step, (a, b) in enumerate(zip(with_planes, without)):
        assert torch.equal(a, b), f"step {step}"
