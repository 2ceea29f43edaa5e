"""Batch invariance of the Triton kernels (``kernels/batch_invariant.py``), interpreted on the CPU: with the switch,
each row (token, request) computed alone and inside batches of 2, 5 and 9 gives the same bits, and the gated delta
rule and the conv give the same bits however a prompt is split into chunks, and as decode steps.

The interpreter multiplies tiles with numpy, so it cannot show what a GPU's dot instructions would do with
another tile shape: these tests pin the arithmetic order the kernels choose (fixed tiles, K in order, no split,
token by token recurrence) and its accuracy against the references; benchmarks/gpu_model_check.py checks the
bits of whole model forwards on a GPU.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from sglang_lite.kernels import (
    causal_conv1d_fn,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    fused_moe,
    fused_recurrent_gated_delta_rule,
    linear,
    w8a8_block_fp8_matmul,
)
from sglang_lite.kernels.batch_invariant import batch_invariant_mode
from sglang_lite.kernels.conv1d import naive as conv_naive
from sglang_lite.kernels.gated_delta_rule import naive as gdn_naive
from sglang_lite.kernels.linear import naive as linear_naive
from sglang_lite.kernels.moe import naive as moe_naive
from sglang_lite.kernels.quant import mxfp4, quantize_blocks
from sglang_lite.kernels.quant import naive as quant_naive

from .utils import assert_rel_close, rel_err

F32, BF16, FP8 = torch.float32, torch.bfloat16, torch.float8_e4m3fn
MXFP4 = "mxfp4"  # uint8 codes and scales (kernels/quant/mxfp4.py), x in float32
BATCHES = (2, 5, 9)
BLOCK = (128, 128)
FP8_TOL = 6e-2  # FP8 activations: one rounding to 3 mantissa bits (tests/kernels/test_fp8.py)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lens]).cumsum(0).to(torch.int32)


def _rows_that_differ(run) -> list[tuple[int, int, float]]:
    """(batch rows, row, largest difference) wherever row i of ``run(0, rows)`` is not ``run(i, i + 1)``: ``run``
    computes rows start:stop of its inputs."""
    alone = [run(i, i + 1) for i in range(max(BATCHES))]
    bad = []
    for rows in BATCHES:
        batched = run(0, rows)
        for i in range(rows):
            if not torch.equal(batched[i : i + 1], alone[i]):
                bad.append((rows, i, (batched[i : i + 1] - alone[i]).abs().max().item()))
    return bad


# ------------------------------------------------------------------------------------------------ linear layers


def _linear_weight(dtype: torch.dtype | str, layout: str):
    """(weight [130, 200], scale) of ``dtype`` (a partial tile of columns and of K, a partial MXFP4 group): [out,
    in], or stored [in, out] (a transposed view) as the CPU's engine stores it."""
    w = _randn(130, 200, seed=3) * 0.05
    if dtype == FP8:
        return quantize_blocks(w, BLOCK, FP8)
    if dtype == MXFP4:
        return mxfp4.quantize(w)
    w = w.to(dtype)
    return (w.t().contiguous().t() if layout == "input_major" else w), None


@pytest.mark.parametrize(
    "x_dtype, w_dtype, layout",
    [
        (F32, F32, "output_major"),
        (F32, BF16, "input_major"),
        (BF16, BF16, "output_major"),
        (F32, FP8, "output_major"),
        (F32, MXFP4, "output_major"),
        (BF16, MXFP4, "output_major"),
    ],
)
def test_linear_rows_alone_equal_rows_batched(nan_allocations, x_dtype, w_dtype, layout):
    weight, scale = _linear_weight(w_dtype, layout)
    block = BLOCK if w_dtype == FP8 else None
    weight_format = MXFP4 if w_dtype == MXFP4 else None
    x = _randn(9, 200, seed=4).to(x_dtype)

    def run(start: int, stop: int) -> torch.Tensor:
        rows = x[start:stop]
        return linear(rows, weight, scale, block, weight_format=weight_format, backend="triton")

    with batch_invariant_mode():
        bad = _rows_that_differ(run)
        got = run(0, 9)
    assert not bad, f"rows differ from the row alone (batch, row, max diff): {bad}"
    if w_dtype == MXFP4:
        want = mxfp4.linear(x.float(), weight, scale)
    else:
        want = linear_naive.linear(
            x.float(), weight.float() if scale is None else weight, scale, block
        )
    assert got.dtype == x_dtype
    assert_rel_close(got.float(), want, x_dtype)


def test_linear_takes_the_triton_matmul_only_with_the_switch(monkeypatch):
    """The automatic choice on a GPU: cuBLAS (``F.linear``) normally, the Triton matmul under the switch."""
    # the package (its attribute of the same name is the function), its tensors made to look like a GPU's
    family = importlib.import_module("sglang_lite.kernels.linear")
    monkeypatch.setattr(family, "use_native", lambda *tensors, backend=None: False)
    monkeypatch.setattr(family, "use_triton", lambda x, backend=None: True)
    calls = []
    monkeypatch.setattr(family.triton_linear, "linear", lambda *a: calls.append(a) or a[0])
    x, w = _randn(3, 8, seed=5), _randn(8, 8, seed=6)
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))
    with batch_invariant_mode():
        linear(x[None], w)  # 3-D rows flattened for it
    assert len(calls) == 1 and calls[0][0].shape == (3, 8)


def test_w8a8_block_fp8_rows_alone_equal_rows_batched(nan_allocations):
    weight, scale = quantize_blocks(_randn(130, 200, seed=7) * 0.05, BLOCK, FP8)
    x = _randn(9, 200, seed=8)

    def run(start: int, stop: int) -> torch.Tensor:
        return w8a8_block_fp8_matmul(x[start:stop], weight, scale, BLOCK, backend="triton")

    with batch_invariant_mode():
        bad = _rows_that_differ(run)
        got = run(0, 9)
    assert not bad, f"rows differ from the row alone (batch, row, max diff): {bad}"
    assert rel_err(got, quant_naive.w8a8_block_fp8_matmul(x, weight, scale, BLOCK)) < FP8_TOL


# --------------------------------------------------------------------------------------------------- fused MoE


def _moe_experts(dtype: torch.dtype | str, experts: int, hidden: int, inter: int):
    """w13, w2 and the scale keywords of ``fused_moe`` for experts in ``dtype`` (or FP8 blocks, or MXFP4)."""
    w13 = _randn(experts, 2 * inter, hidden, seed=9) * 0.05
    w2 = _randn(experts, hidden, inter, seed=10) * 0.05
    if dtype == FP8:
        (w13, s13), (w2, s2) = quantize_blocks(w13, BLOCK, FP8), quantize_blocks(w2, BLOCK, FP8)
        return w13, w2, dict(w13_scale=s13, w2_scale=s2, block=BLOCK)
    if dtype == MXFP4:
        (w13, s13), (w2, s2) = mxfp4.quantize(w13), mxfp4.quantize(w2)
        return w13, w2, dict(w13_scale=s13, w2_scale=s2, weight_format=MXFP4)
    return w13.to(dtype), w2.to(dtype), {}


@pytest.mark.parametrize("dtype", [F32, BF16, FP8, MXFP4])
def test_moe_tokens_alone_equal_tokens_batched(nan_allocations, dtype):
    """Each token's experts (3 slots: 2 routed, 1 shared, as the fused shared expert runs) alone and among
    tokens that share its experts and its blocks of rows."""
    hidden = 128
    w13, w2, scales = _moe_experts(dtype, 4, hidden, 128)
    x = _randn(9, hidden, seed=11).to(dtype if dtype in (F32, BF16) else F32)
    ids = torch.stack([torch.arange(9) % 3, 1 + torch.arange(9) % 2, torch.full((9,), 3)], dim=1)
    weights = torch.softmax(_randn(9, 3, seed=12), dim=-1)

    def run(start: int, stop: int) -> torch.Tensor:
        rows = slice(start, stop)
        return fused_moe(x[rows], w13, w2, weights[rows], ids[rows], backend="triton", **scales)

    with batch_invariant_mode():
        bad = _rows_that_differ(run)
        got = run(0, 9)
    assert not bad, f"tokens differ from the token alone (batch, token, max diff): {bad}"
    if dtype == FP8:
        s13, s2 = scales["w13_scale"], scales["w2_scale"]
        want = moe_naive.fused_moe_fp8(x, w13, w2, weights, ids, s13, s2, BLOCK)
        assert rel_err(got, want) < FP8_TOL
    elif dtype == MXFP4:
        s13, s2 = scales["w13_scale"], scales["w2_scale"]
        assert_rel_close(got, moe_naive.fused_moe_mxfp4(x, w13, w2, weights, ids, s13, s2), F32)
    else:
        want = moe_naive.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
        assert_rel_close(got.float(), want, dtype)


# ----------------------------------------------------------------------------------------- gated delta rule


HK, HV, DK, DV = 1, 2, 16, 24  # two value heads per key head; dv not a power of two


def _gdn_inputs(tokens: int, seed: int, dtype: torch.dtype = F32):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(tokens, HK, DK, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(tokens, HV, DV, generator=gen).to(dtype)
    a, b = torch.randn(tokens, HV, generator=gen), torch.randn(tokens, HV, generator=gen)
    g, beta = gdn_naive.fused_gdn_gating(
        torch.rand(HV, generator=gen), a, torch.rand(HV, generator=gen), b
    )
    return q, k, v, g, beta


def _gdn_prefill(inputs, pool: torch.Tensor, slots: list[int], lens: list[int]) -> torch.Tensor:
    """One prefill call over packed requests (``slots`` of ``pool``), with the switch."""
    with batch_invariant_mode():
        return chunk_gated_delta_rule(
            *inputs, pool, torch.tensor(slots), _cu(lens), backend="triton"
        )


def _gdn_in_chunks(inputs, pool: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """One request's tokens prefilled in successive calls ending at ``cuts`` (its state carried in ``pool``)."""
    outs, start = [], 0
    for end in cuts:
        part = [t[start:end] for t in inputs]
        outs.append(_gdn_prefill(part, pool, [1], [end - start]))
        start = end
    return torch.cat(outs)


def test_gdn_prefill_split_anywhere_gives_the_same_bits(nan_allocations):
    """A prompt of 100 tokens in one call, as 37 + 63, 64 + 36, 1 + 98 + 1, and as 100 decode steps: the outputs
    and the final state are the same bits (a prefix-cache hit resumes from the state after its prefix the same
    way), and match the reference."""
    inputs = _gdn_inputs(100, seed=13)
    start = 0.1 * _randn(3, HV, DK, DV, seed=14)
    runs = {}
    for cuts in ([100], [37, 100], [64, 100], [1, 99, 100]):
        pool = start.clone()
        runs[str(cuts)] = (_gdn_in_chunks(inputs, pool, cuts), pool)
    pool, steps = start.clone(), []
    with batch_invariant_mode():
        for t in range(100):
            token = [x[t : t + 1] for x in inputs]
            steps.append(
                fused_recurrent_gated_delta_rule(*token, pool, torch.tensor([1]), backend="triton")
            )
    runs["decode steps"] = (torch.cat(steps), pool)
    one_pass, one_pool = runs["[100]"]
    for name, (out, final) in runs.items():
        assert torch.equal(out, one_pass), f"{name}: max diff {(out - one_pass).abs().max().item()}"
        assert torch.equal(final, one_pool), (
            f"{name}: state max diff {(final - one_pool).abs().max()}"
        )
    want_pool = start.clone()
    want = gdn_naive.chunk_gated_delta_rule(*inputs, want_pool, torch.tensor([1]), _cu([100]))
    assert_rel_close(one_pass, want, F32)
    assert_rel_close(one_pool, want_pool, F32, "state pool")


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_gdn_request_alone_equals_request_packed(nan_allocations, dtype):
    """Request i alone and packed among 2, 5 and 9 requests of different lengths: the same output bits and final
    state."""
    lens = [5, 1, 9, 4, 7, 2, 6, 3, 8]
    inputs = _gdn_inputs(sum(lens), seed=15, dtype=dtype)
    start = 0.1 * _randn(10, HV, DK, DV, seed=16)
    offsets = _cu(lens).tolist()

    def request(i: int) -> list[torch.Tensor]:
        return [t[offsets[i] : offsets[i + 1]] for t in inputs]

    alone = []
    for i in range(len(lens)):
        pool = start.clone()
        alone.append((_gdn_prefill(request(i), pool, [i + 1], [lens[i]]), pool[i + 1]))
    for rows in BATCHES:
        pool = start.clone()
        packed = _gdn_prefill(
            [t[: offsets[rows]] for t in inputs], pool, list(range(1, rows + 1)), lens[:rows]
        )
        for i in range(rows):
            out, final = alone[i]
            assert torch.equal(packed[offsets[i] : offsets[i + 1]], out), f"request {i} of {rows}"
            assert torch.equal(pool[i + 1], final), f"request {i} of {rows}: state"


# ---------------------------------------------------------------------------------------------------- conv1d


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_conv1d_prefill_split_anywhere_and_decode_give_the_same_bits(nan_allocations, dtype):
    """40 tokens (three tiles of 16) in one call, as 2 + 38, 17 + 23 and 16 + 1 + 23 (each part continuing the
    pooled inputs), as 40 decode steps, and packed after other requests: the same bits, matching the reference."""
    dim, taps = 24, 4
    x = _randn(40, dim, seed=17).to(dtype)
    weight = _randn(dim, taps, seed=18).to(dtype)
    start = _randn(3, dim, taps - 1, seed=19).to(dtype)

    def in_chunks(cuts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        pool, outs, begin = start.clone(), [], 0
        for end in cuts:
            part = x[begin:end]
            slot, lens = torch.tensor([1]), _cu([end - begin])
            outs.append(causal_conv1d_fn(part, weight, pool, slot, lens, backend="triton"))
            begin = end
        return torch.cat(outs), pool[1]

    one_pass, one_state = in_chunks([40])
    runs = {str(cuts): in_chunks(cuts) for cuts in ([2, 40], [17, 40], [16, 17, 40])}
    pool = start.clone()
    steps = [
        causal_conv1d_update(x[t : t + 1], weight, pool, torch.tensor([1]), backend="triton")
        for t in range(40)
    ]
    runs["decode steps"] = (torch.cat(steps), pool[1])
    pool = start.clone()
    packed = torch.cat([_randn(5, dim, seed=20).to(dtype), x])
    slots = torch.tensor([2, 1])
    out = causal_conv1d_fn(packed, weight, pool, slots, _cu([5, 40]), backend="triton")
    runs["packed"] = (out[5:], pool[1])
    for name, (out, state) in runs.items():
        assert torch.equal(out, one_pass), f"{name}: max diff {(out - one_pass).abs().max().item()}"
        assert torch.equal(state, one_state), f"{name}: conv state differs"
    want_pool = start.clone()
    want = conv_naive.causal_conv1d_fn(x, weight, want_pool, torch.tensor([1]), _cu([40]))
    assert_rel_close(one_pass.float(), want.float(), dtype)
    assert torch.equal(one_state, want_pool[1])
