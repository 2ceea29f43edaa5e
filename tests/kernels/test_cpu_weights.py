"""The C++ CPU kernels on bf16 and block-FP8 weights (widened to float32 in registers, or bf16 through vdpbf16ps)
against the float32 reference on the widened or dequantized weights, over awkward shapes and both layouts.

Outputs are allocated in C++, out of reach of the NaN poisoning: each case runs twice on fresh inputs of the same
shape, so an element left unwritten would hold the first run's value and fail the second comparison.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_lite.kernels import cpu, fused_moe, linear
from sglang_lite.kernels.moe import naive as moe_ref
from sglang_lite.kernels.quant.naive import dequantize_blocks, quantize_blocks

from .utils import assert_rel_close

F32 = torch.float32
BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
BLOCK = (128, 128)
MODES = ["auto", "widen", "dot"]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    cpu.require()


@pytest.fixture(params=MODES)
def bf16_dot(request, monkeypatch) -> str:
    """Every bf16 path: vdpbf16ps where the CPU has it and it pays (auto), at every row count (dot), and the
    widening path every CPU runs."""
    monkeypatch.setenv("SGLANG_CPU_BF16_DOT", request.param)
    return request.param


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _input_major(w: torch.Tensor) -> torch.Tensor:
    """The same values stored [in, out] under their [out, in] shape, as weight_layout stores them on the CPU."""
    return w.transpose(-1, -2).contiguous().transpose(-1, -2)


def _bf16_exact(x: torch.Tensor) -> torch.Tensor:
    """float32 values a bf16 holds exactly: vdpbf16ps rounds nothing of them."""
    return x.to(BF16).to(F32)


def _twice(run, make_inputs):
    """Runs ``run`` on two fresh sets of inputs of the same shape; returns both (outputs, inputs)."""
    return [(run(*inputs), inputs) for inputs in (make_inputs(0), make_inputs(100))]


@pytest.mark.parametrize("rows", [1, 3, 8, 33, 300])
@pytest.mark.parametrize("columns", [16, 17, 48, 300, 1100])
@pytest.mark.parametrize("depth", [7, 64, 100, 300])
@pytest.mark.parametrize("layout", ["in_out", "out_in"])
def test_linear_bf16(bf16_dot, rows, columns, depth, layout):
    """Row counts around the blocks of 8 rows and the 256-row panels, widths around the 512-, 128-, 32- and
    16-column blocks and a scalar tail, odd depths (a weight row without a pair) and one over the 256 weight rows
    a widened block runs at a time; activations bf16-exact, so every path must give the float32 product of the
    widened weight."""

    def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = _bf16_exact(_randn(rows, depth + 3, seed=seed))[:, 1 : 1 + depth]  # strided rows
        w = _randn(columns, depth, seed=seed + 1).to(BF16)
        return x, _input_major(w) if layout == "in_out" else w

    for got, (x, w) in _twice(linear, inputs):
        assert got.dtype == F32
        assert_rel_close(got, F.linear(x, w.float()), F32)


@pytest.mark.parametrize("rows", [1, 2, 33])
def test_linear_bf16_activation_precision(bf16_dot, rows):
    """The widening path keeps float32 activations (float32 accuracy); vdpbf16ps rounds them to bf16 (bf16
    accuracy, and visibly so where the kernels take it; a width of whole 32-column blocks, which all take it)."""
    x, w = _randn(rows, 256, seed=0), _input_major(_randn(1088, 256, seed=1).to(BF16))
    got, want = linear(x, w), F.linear(x, w.float())
    rounded = cpu.bf16_dot_takes(rows)
    assert_rel_close(got, want, BF16 if rounded else F32)
    if rounded:
        assert_rel_close(got, F.linear(_bf16_exact(x), w.float()), F32, "rounded activations")
        assert not torch.allclose(got, want, rtol=0, atol=1e-6)


def test_which_products_take_vdpbf16ps():
    """widen: none; dot: every row count where the CPU has the instruction; auto: none up to 8 rows (products bound
    by reading the weight, which the widened ones read faster), more where the CPU has it and runs vdpbf16ps at the
    FMA's products per second or more (measured once: 0 without the instruction)."""
    have, speed = cpu.has_dpbf16(), cpu.bf16_dot_speed()
    assert (speed > 0) == have
    modes = cpu.BF16_DOT_MODES
    for rows in (1, 2, 3, 8, 9, 33, 300):
        assert not cpu.bf16_dot_takes(rows, modes["widen"])
        assert cpu.bf16_dot_takes(rows, modes["dot"]) == have
        assert cpu.bf16_dot_takes(rows, modes["auto"]) == (have and rows > 8 and speed >= 1.0)


def _fp8_weight(n: int, k: int, seed: int, stack: int | None = None):
    """An FP8 weight [n, k] (or [stack, n, k]) with its 128x128 block scales, some elements forced to zero, -0 and
    the subnormals 2^-9 and -7 * 2^-9 of e4m3 (times the block's scale)."""
    shape = (n, k) if stack is None else (stack, n, k)
    q, scale = quantize_blocks(_randn(*shape, seed=seed), BLOCK, FP8)
    bits = q.view(torch.uint8).clone()
    flat = bits.view(-1)
    for i, pattern in enumerate((0x00, 0x80, 0x01, 0x87)):
        flat[i * 7 :: 53] = pattern
    return bits.view(FP8), scale


@pytest.mark.parametrize("rows", [1, 5, 33, 300])
@pytest.mark.parametrize("columns, depth", [(128, 128), (300, 200), (1024, 64), (640, 129)])
def test_linear_fp8(rows, columns, depth):
    """Block-FP8 weights stored [in, out] against the float32 product of the dequantized weight: partial last
    blocks in both dimensions, 512-wide column runs of one row, signed zeros and subnormals."""

    def inputs(seed: int):
        q, scale = _fp8_weight(columns, depth, seed)
        return _randn(rows, depth, seed=seed + 1), _input_major(q), scale

    def run(x, q, scale):
        return linear(x, q, scale, BLOCK)

    for got, (x, q, scale) in _twice(run, inputs):
        assert_rel_close(got, F.linear(x, dequantize_blocks(q, scale, BLOCK)), F32)


def test_fp8_linear_in_out_in_layout_takes_the_reference():
    """An FP8 weight stored [out, in], or in blocks the kernel does not take, runs the dequantizing reference."""
    q, scale = _fp8_weight(256, 128, seed=0)
    x = _randn(3, 128, seed=1)
    assert not cpu.takes_linear(x, q, scale, BLOCK)
    assert not cpu.takes_linear(x, _input_major(q), scale, (64, 64))
    assert cpu.takes_linear(x, _input_major(q), scale, BLOCK)
    want = F.linear(x, dequantize_blocks(q, scale, BLOCK))
    assert_rel_close(linear(x, q, scale, BLOCK), want, F32)


def _routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    return torch.rand(tokens, top_k, generator=gen), ids.to(torch.int32)


@pytest.mark.parametrize("tokens", [1, 2, 5, 33, 300])
@pytest.mark.parametrize("layout", ["in_out", "out_in"])
@pytest.mark.parametrize("hidden, inter", [(72, 40), (258, 64)])
def test_fused_moe_bf16(bf16_dot, tokens, layout, hidden, inter):
    """bf16 experts against the float32 reference on the widened weights, bf16-exact tokens (the hidden activation
    between the projections is rounded by vdpbf16ps: bf16 accuracy there); experts of many rows (300 tokens) too."""
    experts, top_k = 9, 3

    def inputs(seed: int):
        w13 = (_randn(experts, 2 * inter, hidden, seed=seed) / 8).to(BF16)
        w2 = (_randn(experts, hidden, inter, seed=seed + 1) / 8).to(BF16)
        if layout == "in_out":
            w13, w2 = _input_major(w13), _input_major(w2)
        return (
            _bf16_exact(_randn(tokens, hidden, seed=seed + 2)),
            w13,
            w2,
            *_routing(tokens, experts, top_k, seed),
        )

    rounded = bf16_dot != "widen" and cpu.has_dpbf16() and layout == "in_out" and tokens * top_k > 1
    for got, (x, w13, w2, weights, ids) in _twice(fused_moe, inputs):
        want = moe_ref.fused_moe(x, w13.float(), w2.float(), weights, ids)
        assert_rel_close(got, want, BF16 if rounded else F32)


@pytest.mark.parametrize("tokens", [1, 5, 33, 300])
def test_fused_moe_fp8(tokens):
    """Block-FP8 experts stored [in, out] against the float32 reference on the dequantized experts (the C++ kernel
    keeps the activations float32): 2I = 384 rows of w13 in three 128-row blocks, H = 200 in a partial one."""
    experts, top_k, hidden, inter = 6, 2, 200, 192

    def inputs(seed: int):
        q13, s13 = _fp8_weight(2 * inter, hidden, seed, stack=experts)
        q2, s2 = _fp8_weight(hidden, inter, seed + 1, stack=experts)
        x = _randn(tokens, hidden, seed=seed + 2)
        return x, q13, s13, q2, s2, *_routing(tokens, experts, top_k, seed)

    def run(x, q13, s13, q2, s2, weights, ids):
        w13, w2 = _input_major(q13), _input_major(q2)
        return fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2, block=BLOCK)

    for got, (x, q13, s13, q2, s2, weights, ids) in _twice(run, inputs):
        w13, w2 = dequantize_blocks(q13, s13, BLOCK), dequantize_blocks(q2, s2, BLOCK)
        assert_rel_close(got, moe_ref.fused_moe(x, w13, w2, weights, ids), F32)


def test_mixed_weight_dtypes_are_an_error_naming_them():
    with pytest.raises(RuntimeError, match="must be CPU tensors of one dtype"):
        cpu.fused_moe(
            torch.zeros(1, 8),
            torch.zeros(2, 6, 8, dtype=BF16),
            torch.zeros(2, 8, 3),
            torch.ones(1, 1),
            torch.zeros(1, 1, dtype=torch.int32),
        )


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("columns", [3072, 8205])
@pytest.mark.parametrize("depth", [128, 301])
def test_one_row_through_a_wide_weight(columns, depth, dtype, bf16_dot):
    """One row through a weight of 3072 columns or more (an LM head): each thread sums a range of its rows, read
    whole, and the sums are added (the columns past the last 16 in the scalar tail); a bf16 weight that takes
    vdpbf16ps streams its pairs of rows instead. Activations bf16-exact: vdpbf16ps rounds nothing of them."""

    def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _bf16_exact(_randn(1, depth, seed=seed)), _input_major(
            _randn(columns, depth, seed=seed + 1).to(dtype)
        )

    for got, (x, w) in _twice(linear, inputs):
        assert_rel_close(got, F.linear(x, w.float()), F32)


@pytest.mark.parametrize("rows", [9, 40, 300])
def test_many_rows_through_a_float32_weight(rows):
    """More than 8 rows of a float32 weight stored [in, out] run from contiguous copies of its 32-column blocks
    (as bf16 blocks are widened once); widths around the blocks and a scalar tail, a depth over 256 rows."""

    def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _randn(rows, 300, seed=seed), _input_major(_randn(1100, 300, seed=seed + 1))

    for got, (x, w) in _twice(linear, inputs):
        assert_rel_close(got, F.linear(x, w), F32)


@pytest.mark.parametrize("rows", [7, 13, 14, 19])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_a_short_last_tile_runs_balanced_with_the_full_one(rows, dtype, monkeypatch):
    """Row counts whose last register tile would hold too few rows to keep the FMA units busy (AVX2: 6-row tiles,
    13 = 6 + 6 + 1) run the last full tile and the short one as two of nearly equal size: each row sums the same
    products in k order either way, so every row equals that row run among 24 (full tiles), bit for bit, and the
    float32 product. bf16 widened at every row count (vdpbf16ps, where auto picks it for some counts, has its own
    tiles)."""
    monkeypatch.setenv("SGLANG_CPU_BF16_DOT", "widen")
    depth, columns = 100, 48
    x = _bf16_exact(_randn(24, depth, seed=3))
    w = _input_major(_randn(columns, depth, seed=4).to(dtype))
    with_full_tiles = linear(x, w)
    got = linear(x[:rows], w)
    assert torch.equal(got, with_full_tiles[:rows])
    assert_rel_close(got, F.linear(x[:rows], w.float()), F32)


@pytest.mark.parametrize("rows", [2, 3, 5, 8])
@pytest.mark.parametrize("columns", [512, 1024, 2069, 3088])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_a_few_rows_through_a_split_weight_compute_what_one_row_does(
    rows, columns, dtype, monkeypatch
):
    """A few rows through a weight that one row reads split over K take its parts the same way: 2-8 rows of a weight
    wider than 2048 columns stream its rows four at a time, two rows of a narrower one a row at a time, more rows of
    a narrower one take the column blocks through the parts. Either way each row equals that row alone, bit for bit
    (a decode step of a few requests, a speculative verify step), and the float32 product; the columns past a
    multiple of 16 (2069) in the scalar tail."""
    monkeypatch.setenv("SGLANG_CPU_BF16_DOT", "auto")  # auto widens up to 8 rows on every CPU
    depth = 300
    x = _bf16_exact(_randn(rows, depth, seed=5))
    w = _input_major(_randn(columns, depth, seed=6).to(dtype))
    got = linear(x, w)
    for r in range(rows):
        assert torch.equal(got[r : r + 1], linear(x[r : r + 1], w)), f"row {r}"
    assert_rel_close(got, F.linear(x, w.float()), F32)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_experts_of_one_or_two_rows_read_whole_beside_an_expert_of_more(dtype, monkeypatch):
    """A decode step of a few requests: most experts hit take one or two rows, read whole by a thread each, while an
    expert of four rows takes the column blocks. Every token's output equals that token run alone (each expert
    then one row, read whole), bit for bit, and the float32 reference."""
    # vdpbf16ps rounds the hidden activation per row count
    monkeypatch.setenv("SGLANG_CPU_BF16_DOT", "widen")
    experts, top_k, hidden, inter, tokens = 8, 2, 64, 48, 4
    w13 = _input_major((_randn(experts, 2 * inter, hidden, seed=7) / 8).to(dtype))
    w2 = _input_major((_randn(experts, hidden, inter, seed=8) / 8).to(dtype))
    x = _bf16_exact(_randn(tokens, hidden, seed=9))
    # expert 0 takes all four tokens; experts 1-4 one token each
    ids = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 4]], dtype=torch.int32)
    weights = torch.softmax(_randn(tokens, top_k, seed=10), dim=-1)
    got = fused_moe(x, w13, w2, weights, ids)
    for t in range(tokens):
        alone = fused_moe(x[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1])
        assert torch.equal(got[t : t + 1], alone), f"token {t}"
    assert_rel_close(got, moe_ref.fused_moe(x, w13.float(), w2.float(), weights, ids), F32)


def _planes_weight(columns: int, depth: int, seed: int) -> torch.Tensor:
    """A bf16 [in, out] weight whose rows hold values their tables miss: zeros of both signs, values far below the
    row's others, an infinity and a NaN (each put back bit for bit)."""
    w = (_randn(columns, depth, seed=seed) * 0.02).to(BF16)
    w[: min(columns, 5), 0] = 0.0
    w[1 % columns, 1 % depth] = -0.0
    w[3 % columns, 2 % depth] = 1e-30
    w[(columns - 1), 3 % depth] = -3e-8
    w[2 % columns, (depth - 1)] = float("inf")
    w[4 % columns, (depth - 1)] = float("nan")
    return _input_major(w)


@pytest.mark.parametrize(
    "columns, depth", [(64, 7), (100, 300), (768, 256), (1100, 129), (3088, 300), (6144, 64)]
)
def test_one_row_through_bf16_planes_equals_the_bf16_weight(columns, depth, bf16_dot):
    """A bf16 weight's 12-bit planes (a table of each weight row's high bytes, a 4-bit index a weight, the rest kept
    apart; csrc/bf16_planes.h) give one row's product bit for bit as the bf16 weight does, the columns past a
    multiple of 64 read from the bf16 weight, NaN where the weight holds one; a quarter fewer bytes."""
    w = _planes_weight(columns, depth, seed=7)
    for seed in (8, 9):
        x = _randn(1, depth, seed=seed)
        got, want = cpu.bf16_planes_linear(x, w), linear(x, w)
        assert torch.equal(got.isnan(), want.isnan())
        finite = ~want.isnan()
        assert torch.equal(got[finite], want[finite])
    kept = cpu.bf16_planes_bytes(w)
    assert kept > 0
    if columns * depth >= 16384:  # (a small weight's tables and alignment weigh more)
        assert kept < 0.8 * 2 * columns * depth


def test_bf16_planes_are_not_kept_where_they_would_not_pay():
    """No planes for a weight narrower than a chunk of 64 columns, one stored [out, in], a float32 one, or one whose
    high bytes take too many values for the rows' tables (values over 50 binades): its product reads the weight."""
    narrow = _input_major((_randn(48, 128, seed=1) * 0.02).to(BF16))
    out_in = (_randn(128, 128, seed=2) * 0.02).to(BF16)
    binades = torch.randint(-40, 10, (256, 128), generator=torch.Generator().manual_seed(5))
    noise = _input_major((_randn(256, 128, seed=6) * torch.pow(2.0, binades.float())).to(BF16))
    for w in (narrow, out_in, _input_major(_randn(128, 128, seed=3)), noise):
        assert cpu.bf16_planes_bytes(w) == -1
    x = _randn(1, 128, seed=4)
    assert torch.equal(cpu.bf16_planes_linear(x, noise), linear(x, noise))


@pytest.mark.parametrize("rows", [2, 3, 8])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_a_few_rows_through_a_narrow_large_weight_compute_what_one_row_does(
    rows, dtype, monkeypatch
):
    """A router's weight of few columns but many elements (64 x 1100) is read as whole weight rows over the parts
    of K, as the wider ones are: a few rows through it equal each row alone, bit for bit, and the float32 product."""
    monkeypatch.setenv("SGLANG_CPU_BF16_DOT", "auto")
    x = _bf16_exact(_randn(rows, 1100, seed=5))
    w = _input_major(_randn(64, 1100, seed=6).to(dtype))
    got = linear(x, w)
    for r in range(rows):
        assert torch.equal(got[r : r + 1], linear(x[r : r + 1], w)), f"row {r}"
    assert_rel_close(got, F.linear(x, w.float()), F32)
