"""The C++ CPU kernels on MXFP4 weights read as the checkpoint stores them (``kernels/cpu/csrc/mxfp4.h``): linear
layers and the fused MoE against the references on the exactly dequantized weights (``quant/mxfp4.py``,
``moe.naive.fused_moe_mxfp4``), over awkward shapes (a last group of 32 cut short, K shorter than a group, widths
around the kernels' blocks, row counts around their tiles and panels, a prefill long enough to be chunked); and the
same bits for a row whatever the row count, with and without batch invariance's switch.

Outputs allocated in C++ are out of reach of the NaN poisoning: each case runs twice on fresh inputs of the same
shape, so an element left unwritten would hold the first run's value and fail the second comparison. The chunked
MoE's output is allocated in Python, poisoned there.
"""

from __future__ import annotations

import pytest
import torch

from sglang_lite.kernels import cpu, fused_moe, linear
from sglang_lite.kernels.batch_invariant import batch_invariant_mode
from sglang_lite.kernels.moe import naive as moe_ref
from sglang_lite.kernels.quant import mxfp4

REL_TOL = 1e-5  # float32 accumulation in another order than the reference's
EXPERTS = 8
TOP_K = 2


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    cpu.require()


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _codes(*shape: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 (packed, scales) of a weight [..., K]: every code (-0 included), scales of 2^-7 to 2^2."""
    gen = torch.Generator().manual_seed(seed)
    *rows, k = shape
    packed = torch.randint(0, 256, (*rows, k // 2), generator=gen, dtype=torch.uint8)
    groups = -(-k // mxfp4.GROUP)
    scales = torch.randint(120, 130, (*rows, groups), generator=gen, dtype=torch.uint8)
    return packed, scales


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _codes(n, k, seed=seed)


def _assert_close(got: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> None:
    """max |got - expected| over max |expected| (or ``floor``, if larger) within REL_TOL; NaN fails."""
    assert got.shape == expected.shape and got.dtype == torch.float32
    scale = max(expected.abs().max().item(), floor, 1e-30)
    err = (got.double() - expected.double()).abs().max().item() / scale
    assert err <= REL_TOL, f"relative error {err} > {REL_TOL}"


def _assert_linear_close(
    got: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor
) -> None:
    """Against ``mxfp4.linear``. An output of a few elements can cancel to far below its terms, where float32
    sums (the reference's too) lose relative precision: the scale is at least what a sum of K terms of random
    signs amounts to, sqrt(K) times their mean size (the largest output of a wide weight is above it anyway)."""
    terms = x.abs() @ mxfp4.dequantize(packed, scales).abs().t()
    _assert_close(got, mxfp4.linear(x, packed, scales), terms.max().item() / x.shape[1] ** 0.5)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 65, 300])
@pytest.mark.parametrize("columns", [1, 16, 17, 64, 3072])
@pytest.mark.parametrize("depth", [24, 32, 48, 64, 512])
def test_linear_mxfp4(rows, columns, depth):
    """Depths of a group cut short (24: less than one, 48: one and a half), widths around the one-row tiles and the
    widened blocks; strided rows."""
    for seed in (0, 100):
        x = _randn(rows, depth + 5, seed=seed)[:, 2 : 2 + depth]
        packed, scales = _weight(columns, depth, seed + 1)
        assert cpu.takes_linear_mxfp4(x, packed)
        got = linear(x, packed, scales, weight_format="mxfp4")
        _assert_linear_close(got, x, packed, scales)


@pytest.mark.parametrize("rows", [1, 7])
def test_linear_mxfp4_strided_weight_rows_and_scales(rows):
    """Packed rows further apart than their bytes (a slice of a wider tensor) and scales stored column-major."""
    packed, scales = _codes(40, 200, seed=20)
    packed = packed[::2, 3:43]
    scales = scales[:20, :3].t().contiguous().t()
    assert packed.stride(0) == 200 and scales.stride() == (1, 20)
    for seed in (0, 100):
        x = _randn(rows, 80, seed=seed)
        got = cpu.linear_mxfp4(x, packed, scales)
        _assert_linear_close(got, x, packed.contiguous(), scales.contiguous())


def test_linear_mxfp4_reads_every_scale_exactly():
    """Scales across e8m0's range, the smallest (s = 0: 2^-127, a subnormal, not 0) in whole rows of it, met by
    activations large enough to bring the products back to normal floats."""
    packed, scales = _weight(64, 96, seed=3)
    scales = torch.randint(100, 140, scales.shape, generator=torch.Generator().manual_seed(4))
    scales = scales.to(torch.uint8)
    scales[::3] = 0
    for rows in (1, 9):
        x = _randn(rows, 96, seed=5) * 2.0**100
        got = cpu.linear_mxfp4(x, packed, scales)
        expected = mxfp4.linear(x, packed, scales)
        _assert_close(got[:, ::3], expected[:, ::3])
        _assert_close(got, expected)


def test_other_operands_take_the_reference():
    """bf16 activations and weights whose packed rows are strided are not the kernels': the entry runs the
    reference for them."""
    packed, scales = _weight(32, 64, seed=6)
    x = _randn(3, 64, seed=7)
    assert not cpu.takes_linear_mxfp4(x.bfloat16(), packed)
    strided = torch.zeros(32, 64, dtype=torch.uint8)[:, ::2]
    strided.copy_(packed)
    assert not cpu.takes_linear_mxfp4(x, strided)
    got = linear(x, strided, scales, weight_format="mxfp4")
    _assert_close(got, mxfp4.linear(x, packed, scales))
    assert not cpu.takes_moe_mxfp4(x.bfloat16(), packed.expand(2, -1, -1))


def test_wrong_scales_are_refused_by_the_kernel():
    packed, scales = _weight(16, 64, seed=8)
    with pytest.raises(RuntimeError, match="needs scales"):
        cpu.linear_mxfp4(_randn(1, 64, seed=9), packed, scales[:, :1])


@pytest.mark.parametrize("switch", [False, True])
@pytest.mark.parametrize("columns,depth", [(19, 48), (3072, 512), (20, 24), (200, 1056)])
def test_linear_mxfp4_rows_are_batch_invariant(switch, columns, depth):
    """Each row's bits alone, in the first rows of a batch, and inside batches of every size (row tiles, panels of
    128 rows, the one-row path for a panel's last row; outputs whose lanes are summed one register at a time on one
    path and four at a time on the other)."""
    packed, scales = _weight(columns, depth, seed=10)
    x = _randn(300, depth, seed=11)
    with batch_invariant_mode(switch):
        full = cpu.linear_mxfp4(x, packed, scales)
        for rows in (1, 2, 3, 7, 8, 65, 129):
            assert torch.equal(cpu.linear_mxfp4(x[:rows], packed, scales), full[:rows]), rows
        for row in (0, 5, 128, 299):
            alone = cpu.linear_mxfp4(x[row : row + 1], packed, scales)
            assert torch.equal(alone, full[row : row + 1]), row


def _experts(hidden: int, inter: int, seed: int) -> tuple[torch.Tensor, ...]:
    """MXFP4 experts, one more than the router's: the fused shared expert, as the engine stores it."""
    w13, w13_scale = _codes(EXPERTS + 1, 2 * inter, hidden, seed=seed)
    w2, w2_scale = _codes(EXPERTS + 1, hidden, inter, seed=seed + 1)
    return w13, w2, w13_scale, w2_scale


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-2 of 8 and the shared expert's column (id 8, weight sigmoid of its logit), as moe_route gives them."""
    logits = _randn(tokens, EXPERTS, seed=seed)
    shared = _randn(tokens, 1, seed=seed + 1)
    return moe_ref.moe_route(logits, shared, TOP_K, True, EXPERTS)


@pytest.mark.usefixtures("nan_allocations")
@pytest.mark.parametrize("tokens", [1, 3, 65, 1500])
@pytest.mark.parametrize("hidden,inter", [(48, 40), (256, 128)])
def test_fused_moe_mxfp4(tokens, hidden, inter):
    """Decode and prefill token counts (1500: chunked), groups cut short in both projections."""
    w13, w2, w13_scale, w2_scale = _experts(hidden, inter, seed=tokens)
    for seed in (0, 100):
        x = _randn(tokens, hidden, seed=seed)
        weights, ids = _routing(tokens, seed + 1)
        assert cpu.takes_moe_mxfp4(x, w13)
        args = (x, w13, w2, weights, ids)
        got = fused_moe(*args, w13_scale=w13_scale, w2_scale=w2_scale, weight_format="mxfp4")
        expected = moe_ref.fused_moe_mxfp4(*args, w13_scale, w2_scale)
        _assert_close(got, expected)


def test_fused_moe_mxfp4_any_slots():
    """Ids in any columns (the shared expert first, an expert twice), as the float kernel takes them."""
    w13, w2, w13_scale, w2_scale = _experts(64, 32, seed=12)
    x = _randn(5, 64, seed=13)
    ids = torch.tensor([[8, 1, 1], [0, 8, 7], [3, 3, 3], [8, 2, 5], [6, 0, 8]], dtype=torch.int32)
    weights = torch.rand(5, 3, generator=torch.Generator().manual_seed(14))
    got = cpu.fused_moe_mxfp4(x, w13, w2, weights, ids, w13_scale, w2_scale)
    _assert_close(got, moe_ref.fused_moe_mxfp4(x, w13, w2, weights, ids, w13_scale, w2_scale))


@pytest.mark.parametrize("switch", [False, True])
def test_fused_moe_mxfp4_tokens_are_batch_invariant(switch):
    """A token's bits alone and among 65 (experts of one row and of many)."""
    w13, w2, w13_scale, w2_scale = _experts(96, 64, seed=15)
    x = _randn(65, 96, seed=16)
    weights, ids = _routing(65, seed=17)
    scales = (w13_scale, w2_scale)
    with batch_invariant_mode(switch):
        full = cpu.fused_moe_mxfp4(x, w13, w2, weights, ids, *scales)
        for t in (0, 31, 64):
            one = slice(t, t + 1)
            alone = cpu.fused_moe_mxfp4(x[one], w13, w2, weights[one], ids[one], *scales)
            assert torch.equal(alone, full[one]), t
