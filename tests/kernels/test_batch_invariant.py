"""Batch invariance of the C++ CPU kernels (``kernels/batch_invariant.py``): a row computed alone and the same row
inside batches of any size give the same bits.

With the switch, every path: linear layers of float32, bf16 and FP8 weights in both layouts (MKL's sizes and the
split of K included), the fused MoE (experts of more rows than MKL's threshold included), and extend attention
against decode attention over the same keys; a decode token's conv and delta rule against a prompt token's, and the
decode blocks' elementwise steps the modules take then. Without it, the products a speculative verify step shares with a
decode step (a few rows against one) still agree: every product adds its k terms in k order whatever its tile, and
weights of 128+ columns split K the same way up to 64 rows (3072+ columns at every row count).
"""

from __future__ import annotations

import pytest
import torch

from sglang_lite.kernels import (
    causal_conv1d_fn,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    cpu,
    decode_attention,
    extend_attention,
    fused_moe,
    fused_recurrent_gated_delta_rule,
    linear,
)
from sglang_lite.kernels.batch_invariant import batch_invariant_mode
from sglang_lite.kernels.quant.naive import quantize_blocks

from .utils import assert_rel_close

F32 = torch.float32
BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
BLOCK = (128, 128)
BATCHES = (2, 5, 9, 37, 300)


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    cpu.require()


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _input_major(w: torch.Tensor) -> torch.Tensor:
    return w.transpose(-1, -2).contiguous().transpose(-1, -2)


def _weight(dtype: torch.dtype, n: int, k: int, layout: str):
    """(weight, scale) as the engine stores them: [in, out] (``input_major``) or [out, in]."""
    w = _randn(n, k, seed=n + k) * 0.05
    if dtype == FP8:
        q, scale = quantize_blocks(w, BLOCK, FP8)
        return _input_major(q), scale
    w = w.to(dtype)
    return (_input_major(w) if layout == "input_major" else w), None


def _first_row_differs(run, x: torch.Tensor, batches=BATCHES) -> list[tuple[int, float]]:
    """(rows, largest difference) for each batch whose first row is not the first row computed alone."""
    alone = run(x[:1])
    bad = []
    for rows in batches:
        first = run(x[:rows])[:1]
        if not torch.equal(first, alone):
            bad.append((rows, (first - alone).abs().max().item()))
    return bad


LINEAR_CASES = [
    (F32, "input_major"),
    (F32, "output_major"),
    (BF16, "input_major"),
    (BF16, "output_major"),
    (FP8, "input_major"),
]
# widths: a gate of one column, tails of 16 and of 1, and one past the split of K (3072 columns)
SHAPES = [(1, 64), (17, 100), (1000, 512), (3200, 256)]


@pytest.mark.parametrize("dtype, layout", LINEAR_CASES)
@pytest.mark.parametrize("columns, depth", SHAPES)
@pytest.mark.parametrize("mode", ["auto", "widen"])
def test_linear_rows_are_batch_invariant_with_the_switch(
    dtype, layout, columns, depth, mode, monkeypatch
):
    if dtype == FP8 and columns % 128:
        pytest.skip("FP8 weights come in blocks of 128 output columns")
    monkeypatch.setenv("SGLANG_CPU_BF16_DOT", mode)
    weight, scale = _weight(dtype, columns, depth, layout)
    x = _randn(300, depth, seed=1)
    with batch_invariant_mode():
        bad = _first_row_differs(
            lambda rows: linear(rows, weight, scale, BLOCK if scale is not None else None), x
        )
    assert not bad, f"row 0 alone differs from row 0 in batches of (rows, max diff) {bad}"


@pytest.mark.parametrize("dtype, layout", LINEAR_CASES[:4])
@pytest.mark.parametrize("columns", [1, 3, 8, 15, 24])
@pytest.mark.parametrize("depth", [64, 131])
def test_every_row_through_a_few_columns_is_that_row_alone(dtype, layout, columns, depth):
    """A router's or a gate's few columns (and a wider weight's last few), with the switch: every row of a batch,
    those in full register tiles of rows and those past them, has the bits it has alone, and the values are the
    float64 product's."""
    weight, _ = _weight(dtype, columns, depth, layout)
    x = _randn(37, depth, seed=3)
    with batch_invariant_mode():
        batch = linear(x, weight, None, None)
        alone = [linear(x[r : r + 1], weight, None, None)[0] for r in range(len(x))]
    bad = [r for r in range(len(x)) if not torch.equal(batch[r], alone[r])]
    assert not bad, f"rows {bad} differ from themselves alone"
    want = (x.double() @ weight.double().T).float()
    torch.testing.assert_close(batch, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "dtype, layout", [(F32, "input_major"), (BF16, "input_major"), (FP8, "input_major")]
)
@pytest.mark.parametrize("columns, depth", [(1000, 512), (3200, 256), (4096, 1024)])
@pytest.mark.parametrize("mode", ["widen", "dot"])
def test_verify_sized_batches_match_one_row_without_the_switch(
    dtype, layout, columns, depth, mode, monkeypatch
):
    """A verify step's rows (2 to 64 here) through the products a decode step of one row takes: the same bits.
    bf16 modes are forced (auto chooses by a timing on CPUs where vdpbf16ps is slow: README)."""
    monkeypatch.setenv("SGLANG_CPU_BF16_DOT", mode)
    weight, scale = _weight(dtype, columns, depth, layout)
    x = _randn(64, depth, seed=2)
    bad = _first_row_differs(
        lambda rows: linear(rows, weight, scale, BLOCK if scale is not None else None),
        x,
        (2, 4, 9, 33, 64),
    )
    assert not bad, f"row 0 alone differs from row 0 in batches of (rows, max diff) {bad}"


@pytest.mark.parametrize("rows", [2, 9, 40])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_rows_through_a_wide_weight_split_k_as_one_row_does(rows, dtype, monkeypatch):
    """Several rows through a weight of 3072+ columns take the parts of K one row takes: against float32."""
    monkeypatch.setenv("SGLANG_CPU_BF16_DOT", "widen")
    weight, _ = _weight(dtype, 3203, 301, "input_major")
    x = _randn(rows, 301, seed=3)
    assert_rel_close(linear(x, weight), torch.nn.functional.linear(x, weight.float()), F32)


def _experts(dtype: torch.dtype, experts: int, hidden: int, inter: int):
    w13 = _randn(experts, 2 * inter, hidden, seed=3) * 0.05
    w2 = _randn(experts, hidden, inter, seed=4) * 0.05
    if dtype == FP8:
        (q13, s13), (q2, s2) = quantize_blocks(w13, BLOCK, FP8), quantize_blocks(w2, BLOCK, FP8)
        return _input_major(q13), _input_major(q2), dict(w13_scale=s13, w2_scale=s2, block=BLOCK)
    return _input_major(w13.to(dtype)), _input_major(w2.to(dtype)), {}


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_whole_experts_of_one_or_two_rows_match_their_blocks(dtype, monkeypatch):
    """Experts of one or two rows, at least one a thread, run whole (each thread reads its experts' weight rows one
    at a time); the same tokens among others that give each expert more rows run in blocks of columns. Both add
    each output's k terms in k order: the same bits."""
    monkeypatch.setenv("SGLANG_CPU_BF16_DOT", "widen")
    experts, top_k, hidden, inter = 6, 2, 256, 128
    w13, w2, scales = _experts(dtype, experts, hidden, inter)
    x = _randn(12, hidden, seed=7)
    # tokens 0 and 1 share experts 0 and 1 (two rows each); every later token hits them too
    ids = torch.tensor([[0, 1]] * 12)
    ids[0] = torch.tensor([0, 2])  # expert 2: one row, while tokens 0-1 run alone
    weights = torch.softmax(_randn(12, top_k, seed=8), dim=-1)
    alone = fused_moe(x[:2], w13, w2, weights[:2], ids[:2], **scales)
    crowded = fused_moe(x, w13, w2, weights, ids, **scales)[:2]
    assert torch.equal(alone, crowded), (alone - crowded).abs().max().item()


@pytest.mark.parametrize("dtype", [F32, BF16, FP8])
@pytest.mark.parametrize("switch", [True, False])
def test_moe_token_is_batch_invariant(dtype, switch):
    """Token 0 alone and among 300 tokens that crowd its experts (past MKL's 128 rows an expert for float32):
    with the switch always the same bits; without it, for the few tokens of a verify step."""
    experts, top_k, hidden, inter = 8, 2, 256, 128
    w13, w2, scales = _experts(dtype, experts, hidden, inter)
    x = _randn(300, hidden, seed=5)
    ids = torch.stack([torch.arange(300) % 3, 3 + torch.arange(300) % 2], dim=1)  # experts 0-4 only
    weights = torch.softmax(_randn(300, top_k, seed=6), dim=-1)

    def run(rows: torch.Tensor) -> torch.Tensor:
        n = rows.shape[0]
        return fused_moe(rows, w13, w2, weights[:n], ids[:n], **scales)

    with batch_invariant_mode(switch):
        bad = _first_row_differs(run, x, BATCHES if switch else (2, 5, 9, 16))
    assert not bad, f"token 0 alone differs from token 0 in batches of (tokens, max diff) {bad}"


def _pool(tokens: int, kv_heads: int, hd: int):
    k_cache = _randn(tokens, kv_heads, hd, seed=7)
    v_cache = _randn(tokens, kv_heads, hd, seed=8)
    return k_cache, v_cache


def test_extend_attention_is_decode_attention_per_token_with_the_switch():
    """Each new token of an extend, in one pass, in two chunks (the second over the first's keys as its prefix)
    and batched with another request, equals a decode step of that token over the same keys."""
    heads, kv_heads, hd, length = 4, 2, 32, 40
    k_cache, v_cache = _pool(2 * length, kv_heads, hd)
    table = torch.arange(2 * length, dtype=torch.int32).view(
        2, length
    )  # request r: slots r * length ...
    q = _randn(2 * length, heads, hd, seed=9)
    scale = hd**-0.5

    def extend(rows, prefixes, extends, queries):
        t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        return extend_attention(
            queries, k_cache, v_cache, table, t(rows), t(prefixes), t(extends), scale
        )

    with batch_invariant_mode():
        decoded = decode_attention(
            q[:length],
            k_cache,
            v_cache,
            table,
            torch.zeros(length, dtype=torch.int64),
            torch.arange(1, length + 1),
            scale,
        )
        one_pass = extend([0], [0], [length], q[:length])
        chunks = torch.cat(
            [extend([0], [0], [13], q[:13]), extend([0], [13], [length - 13], q[13:length])]
        )
        batched = extend([1, 0], [0, 0], [length, length], torch.cat([q[length:], q[:length]]))[
            length:
        ]
    for name, got in (("one pass", one_pass), ("two chunks", chunks), ("batched", batched)):
        assert torch.equal(got, decoded), f"{name}: max diff {(got - decoded).abs().max().item()}"


def test_decode_token_is_a_prompt_token_with_the_switch():
    """The conv and the delta rule of a decode step (one token a request) equal the last token of a prefill over
    the same tokens, state for state: a retracted request prefilled again computes what its decode steps did."""
    tokens, dim, taps, hk, hv, dk, dv = 9, 48, 4, 2, 4, 32, 32
    x = _randn(tokens, dim, seed=10)
    weight = _randn(dim, taps, seed=11) * 0.3
    q, k = _randn(tokens, hk, dk, seed=12), _randn(tokens, hk, dk, seed=13)
    v = _randn(tokens, hv, dv, seed=14)
    g, beta = -torch.rand(tokens, hv) * 0.5, torch.rand(tokens, hv)
    slot = torch.tensor([1], dtype=torch.int64)
    cu = torch.tensor([0, tokens], dtype=torch.int64)
    head = torch.tensor([0, tokens - 1], dtype=torch.int64)

    def pools():
        return torch.zeros(3, dim, taps - 1), torch.zeros(3, hv, dk, dv)

    with batch_invariant_mode():
        conv_all, ssm_all = pools()
        conv_out = causal_conv1d_fn(x, weight, conv_all, slot, cu)
        delta_out = chunk_gated_delta_rule(q, k, v, g, beta, ssm_all, slot, cu)
        conv_step, ssm_step = pools()
        causal_conv1d_fn(x[:-1], weight, conv_step, slot, head)
        chunk_gated_delta_rule(q[:-1], k[:-1], v[:-1], g[:-1], beta[:-1], ssm_step, slot, head)
        last = causal_conv1d_update(x[-1:], weight, conv_step, slot)
        last_delta = fused_recurrent_gated_delta_rule(
            q[-1:], k[-1:], v[-1:], g[-1:], beta[-1:], ssm_step, slot
        )
    assert torch.equal(last, conv_out[-1:]) and torch.equal(conv_step, conv_all)
    assert torch.equal(last_delta, delta_out[-1:]) and torch.equal(ssm_step, ssm_all)


def test_block_steps_for_the_modules_match_their_reference_forms():
    """The decode blocks' elementwise steps as ops (the modules take them under the switch): rotary, the output
    gate, silu * up and a separate shared expert's gated sum, against their PyTorch forms."""
    from sglang_lite.kernels.rotary import naive as rotary_ref

    q = _randn(5, 4, 64, seed=15)[:, :, :48]  # a strided view, as the modules hand it over
    positions = torch.tensor([0, 3, 7, 1, 30])
    cos_sin = _randn(32, 32, seed=16)
    want, _ = rotary_ref.apply_rotary(q, q, positions, cos_sin, 32)
    assert_rel_close(cpu.rotary_rows(q, positions, cos_sin, 32), want, F32)
    out, gate = _randn(5, 4, 16, seed=17), _randn(5, 4, 32, seed=18)[..., 16:]
    assert_rel_close(cpu.sigmoid_gate(out, gate), out * torch.sigmoid(gate), F32)
    gate_up = _randn(6, 40, seed=19)
    gate_half, up = gate_up.chunk(2, dim=-1)
    assert_rel_close(cpu.silu_and_mul(gate_up), torch.nn.functional.silu(gate_half) * up, F32)
    routed, shared, logit = _randn(6, 24, seed=20), _randn(6, 24, seed=21), _randn(6, 1, seed=22)
    assert_rel_close(
        cpu.add_gated(routed, shared, logit), routed + torch.sigmoid(logit) * shared, F32
    )


def test_work_taken_as_the_threads_free_up_gives_the_same_bits_every_call(monkeypatch):
    """Prefill-sized products hand their work items to whichever of the threads is free (common.h's
    parallel_items): every item must run exactly once, and its values must not depend on the thread. Many calls on
    two threads (the claims race each other) each give the first call's bits, and that is the product: a split of
    K, blocks widened once for many rows, experts of unequal rows, the delta rule's (request, head) items, and MXFP4
    blocks and experts."""
    from sglang_lite.kernels.quant import mxfp4

    # vdpbf16ps hosts too take the widened blocks
    monkeypatch.setenv("SGLANG_CPU_BF16_DOT", "widen")
    codes = torch.Generator().manual_seed(40)

    def mx(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
        *rows, k = shape
        packed = torch.randint(0, 256, (*rows, k // 2), generator=codes, dtype=torch.uint8)
        return packed, torch.randint(120, 130, (*rows, k // 32), generator=codes, dtype=torch.uint8)

    w_split, w_many = (
        _weight(BF16, 1100, 300, "input_major")[0],
        _weight(BF16, 1100, 256, "input_major")[0],
    )
    w13, w2, _ = _experts(BF16, 32, 256, 128)
    (p13, s13), (p2, s2), (pw, sw) = mx(32, 256, 256), mx(32, 256, 128), mx(300, 256)
    x = _randn(300, 300, seed=41)
    weights, ids = torch.topk(torch.softmax(_randn(300, 32, seed=42), -1), 4)
    tokens, hk, hv, dk, dv = 62, 2, 4, 32, 32
    cu = torch.tensor([0, 5, 45, 62], dtype=torch.int64)
    slots = torch.tensor([2, 0, 1], dtype=torch.int64)
    q, k = _randn(tokens, hk, dk, seed=43), _randn(tokens, hk, dk, seed=44)
    v, g, beta = (
        _randn(tokens, hv, dv, seed=45),
        -torch.rand(tokens, hv) * 0.5,
        torch.rand(tokens, hv),
    )

    def delta_rule() -> torch.Tensor:
        states = _randn(3, hv, dk, dv, seed=46)
        out = chunk_gated_delta_rule(q, k, v, g, beta, states, slots, cu)
        return torch.cat([out.flatten(), states.flatten()])

    cases = {
        "split of K": (lambda: linear(x[:3], w_split), lambda: x[:3] @ w_split.float().t()),
        "blocks widened once": (
            lambda: linear(x[:, :256], w_many),
            lambda: x[:, :256] @ w_many.float().t(),
        ),
        "experts": (
            lambda: fused_moe(x[:, :256], w13, w2, weights, ids),
            lambda: fused_moe(x[:, :256], w13.float(), w2.float(), weights, ids),
        ),
        "delta rule": (delta_rule, None),
        "MXFP4 blocks": (
            lambda: cpu.linear_mxfp4(x[:65, :256], pw, sw),
            lambda: mxfp4.linear(x[:65, :256], pw, sw),
        ),
        "MXFP4 experts": (
            lambda: cpu.fused_moe_mxfp4(x[:, :256], p13, p2, weights, ids, s13, s2),
            lambda: cpu.fused_moe(
                x[:, :256], mxfp4.dequantize(p13, s13), mxfp4.dequantize(p2, s2), weights, ids
            ),
        ),
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for name, (run, reference) in cases.items():
            first = run()
            if reference is not None:
                assert_rel_close(first, reference(), F32, name)
            differ = sum(not torch.equal(run(), first) for _ in range(100))
            assert differ == 0, f"{name}: {differ} of 100 calls differ from the first"
    finally:
        torch.set_num_threads(threads)
