"""Block FP8: the Triton per-token-group quantization, W8A8 block GEMM and FP8 fused MoE (interpreted on the CPU)
against the PyTorch references, and the references against plain float arithmetic on the dequantized weights."""

from __future__ import annotations

import pytest
import torch

from sglang_lite.kernels import moe, per_token_group_quant_fp8, w8a8_block_fp8_matmul
from sglang_lite.kernels.moe import naive as moe_naive
from sglang_lite.kernels.quant import dequantize_blocks, e4m3fn_to_e4m3fnuz, naive, quantize_blocks

from .utils import rel_err

FORMATS = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]  # NVIDIA and MI355; MI300 (gfx942)
# one FP8 rounding of the activations (3 mantissa bits) over sums of a few hundred products
FP8_TOL = 6e-2


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _fp8_weight(shape: tuple[int, ...], block: tuple[int, int], dtype: torch.dtype, seed: int = 1):
    return quantize_blocks(_randn(*shape, seed=seed) * 0.05, block, dtype)


# one program per (row, group): 130 rows reach no case that 500 did, at a quarter of the interpreter's time
@pytest.mark.parametrize("num_rows", [1, 65, 130])
@pytest.mark.parametrize("num_cols,group", [(48, 128), (257, 128), (200, 32)])
@pytest.mark.parametrize("fp8", FORMATS)
def test_per_token_group_quant_matches_reference(nan_allocations, num_rows, num_cols, group, fp8):
    x = _randn(num_rows, num_cols, seed=num_rows) * 3
    x[0, :group] = 0.0  # an all-zero group: a tiny scale, zeros out
    q, s = per_token_group_quant_fp8(x, group, fp8, backend="triton")
    want_q, want_s = naive.per_token_group_quant(x, group, fp8)
    assert q.dtype == fp8 and s.shape == (num_rows, -(-num_cols // group))
    assert torch.equal(s, want_s)
    assert torch.equal(q.float(), want_q.float())
    assert rel_err(naive.dequantize_groups(q, s, group), x) < 0.07


# a decode batch's 16-row tile; 64-row tiles, the last one partial
@pytest.mark.parametrize("num_rows", [1, 63, 65, 130])
@pytest.mark.parametrize(
    "shape,block", [((130, 200), (128, 128)), ((96, 48), (128, 128)), ((72, 80), (8, 16))]
)
@pytest.mark.parametrize(
    "fp8,dtype",
    [
        (torch.float8_e4m3fn, torch.float32),
        (torch.float8_e4m3fn, torch.bfloat16),
        (torch.float8_e4m3fnuz, torch.float32),
    ],
)
def test_w8a8_block_fp8_matmul_matches_reference(
    nan_allocations, num_rows, shape, block, fp8, dtype
):
    w, scale = _fp8_weight(shape, block, fp8)
    x = _randn(num_rows, shape[1], seed=num_rows, dtype=dtype)
    got = w8a8_block_fp8_matmul(x, w, scale, block, backend="triton")
    want = naive.w8a8_block_fp8_matmul(x, w, scale, block)
    assert got.dtype == dtype and got.shape == (num_rows, shape[0])
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    # and the reference is x @ W^T on the dequantized weight, up to the activations' FP8 rounding
    assert rel_err(want.float(), x.float() @ dequantize_blocks(w, scale, block).t()) < FP8_TOL


def test_matmul_keeps_leading_dimensions_and_rejects_wrong_scales():
    w, scale = _fp8_weight((64, 48), (128, 128), torch.float8_e4m3fn)
    x = _randn(2, 3, 48)
    assert w8a8_block_fp8_matmul(x, w, scale, (128, 128), backend="triton").shape == (2, 3, 64)
    with pytest.raises(ValueError, match=r"w_scale must be \[1, 1\]"):
        w8a8_block_fp8_matmul(x, w, torch.ones(2, 1), (128, 128), backend="triton")


def test_e4m3fnuz_holds_the_same_weights():
    w, scale = _fp8_weight((130, 200), (128, 128), torch.float8_e4m3fn)
    w[0, 0] = -0.0  # the e4m3fn pattern that is NaN in e4m3fnuz
    fnuz, fnuz_scale = e4m3fn_to_e4m3fnuz(w, scale)
    assert fnuz.dtype == torch.float8_e4m3fnuz
    assert torch.equal(
        dequantize_blocks(fnuz, fnuz_scale, (128, 128)), dequantize_blocks(w, scale, (128, 128))
    )


@pytest.mark.parametrize("block", [(128, 128), (16, 32)])
def test_quantize_blocks_round_trip_within_fp8_rounding(block):
    w = _randn(130, 200)
    q, s = quantize_blocks(w, block, torch.float8_e4m3fn)
    assert s.shape == (-(-130 // block[0]), -(-200 // block[1]))
    assert (
        (dequantize_blocks(q, s, block) - w).abs() <= w.abs() / 16 + 1e-6
    ).all()  # half an FP8 ulp


@pytest.mark.parametrize("num_tokens", [1, 65, 150])  # 150: several 16-row blocks of every expert
@pytest.mark.parametrize(
    "hidden,inter,block", [(64, 32, (128, 128)), (200, 136, (128, 128)), (64, 48, (16, 32))]
)
@pytest.mark.parametrize("fp8", FORMATS)
def test_fused_moe_fp8_matches_reference(nan_allocations, num_tokens, hidden, inter, block, fp8):
    num_experts, top_k = 9, 2
    w13, w13_scale = _fp8_weight((num_experts, 2 * inter, hidden), block, fp8, seed=2)
    w2, w2_scale = _fp8_weight((num_experts, hidden, inter), block, fp8, seed=3)
    x = _randn(num_tokens, hidden, seed=num_tokens)
    weights, ids = moe_naive.topk_softmax(_randn(num_tokens, num_experts - 1, seed=5), top_k)
    # the fused shared expert rides along as the last expert, with its own weight
    weights = torch.cat([weights, torch.sigmoid(_randn(num_tokens, 1, seed=6))], 1)
    ids = torch.cat([ids, torch.full_like(ids[:, :1], num_experts - 1)], 1)
    scales = dict(w13_scale=w13_scale, w2_scale=w2_scale, block=block)
    got = moe.fused_moe(x, w13, w2, weights, ids, backend="triton", **scales)
    want = moe.fused_moe(x, w13, w2, weights, ids, backend="torch", **scales)
    # the activation between the GEMMs is rounded to FP8: a different summation order may flip one rounding
    assert rel_err(got, want) < 1e-2
    plain = moe_naive.fused_moe(
        x,
        dequantize_blocks(w13, w13_scale, block),
        dequantize_blocks(w2, w2_scale, block),
        weights,
        ids,
    )
    assert rel_err(want, plain) < FP8_TOL


def test_fused_moe_fp8_rejects_wrong_scales():
    w13, w13_scale = _fp8_weight((4, 64, 48), (128, 128), torch.float8_e4m3fn)
    w2, w2_scale = _fp8_weight((4, 48, 32), (128, 128), torch.float8_e4m3fn)
    weights, ids = moe_naive.topk_softmax(_randn(3, 4), 2)
    with pytest.raises(ValueError, match="w2_scale must be float32"):
        moe.fused_moe(
            _randn(3, 48),
            w13,
            w2,
            weights,
            ids,
            w13_scale=w13_scale,
            w2_scale=w2_scale[:, :, :0],
            block=(128, 128),
            backend="triton",
        )
