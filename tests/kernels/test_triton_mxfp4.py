"""Triton MXFP4 kernels (interpreted on the CPU) against the references of ``kernels/quant/mxfp4.py``: the linear
layer and the fused MoE over awkward shapes (K = 48 and 40: a partial last group and a partial K tile; 1, 3 and 65
tokens; 8 routed experts top-2 plus the fused shared expert as a ninth), outputs poisoned with NaN.

On gfx950 the products of bf16 and fp16 activations go through ``tl.dot_scaled``. Triton's interpreter emulates it
with numpy, so these tests also run that path (a patched platform) and check what its operands mean: bytes packed
along K, scales [N, K / 32] not transposed, a partial group's padding. Whether gfx950's compiler lowers it, and how
fast, only benchmarks/triton_resources.py (it compiles for gfx950) and benchmarks/gpu_check.py on an MI355X tell.
"""

from __future__ import annotations

import pytest
import torch

from sglang_lite.kernels import dispatch, fused_moe, linear
from sglang_lite.kernels.linear import triton_linear
from sglang_lite.kernels.moe import naive as moe_naive
from sglang_lite.kernels.quant import mxfp4

from .utils import assert_rel_close

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
NUM_EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 48, 40


def _randn(*shape: int, seed: int, std: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std


@pytest.fixture
def on_gfx950(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launchers see an MI355X: MXFP4 products of 16-bit activations take ``tl.dot_scaled``."""
    monkeypatch.setattr(dispatch, "gpu_arch", lambda: "gfx950")
    assert triton_linear.mxfp4_dot_scaled(BF16) == "bf16"


def _check_linear(tokens: int, out_features: int, in_features: int, dtype: torch.dtype) -> None:
    packed, scales = mxfp4.quantize(_randn(out_features, in_features, seed=1, std=0.1))
    x = _randn(tokens, in_features, seed=2).to(dtype)
    got = linear(x, packed, scales, weight_format="mxfp4", backend="triton")
    assert got.dtype == dtype
    assert_rel_close(got, mxfp4.linear(x, packed, scales), dtype)


@pytest.mark.parametrize(
    "tokens,out_features,in_features", [(1, 40, 48), (3, 70, 96), (65, 33, 200)]
)
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_linear_mxfp4_matches_reference(nan_allocations, tokens, out_features, in_features, dtype):
    _check_linear(tokens, out_features, in_features, dtype)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_linear_mxfp4_dot_scaled_matches_reference(nan_allocations, on_gfx950, dtype):
    _check_linear(65, 70, 48, dtype)


def test_linear_mxfp4_keeps_leading_dimensions():
    packed, scales = mxfp4.quantize(_randn(24, 64, seed=3))
    x = _randn(2, 3, 64, seed=4)
    got = linear(x, packed, scales, weight_format="mxfp4", backend="triton")
    assert got.shape == (2, 3, 24)
    assert_rel_close(got, mxfp4.linear(x.reshape(6, 64), packed, scales).view(2, 3, 24), F32)


def _moe_case(tokens: int, dtype: torch.dtype):
    """x, the MXFP4 experts (the shared one last) and routing: top-2 of 8 plus the shared expert's column."""
    w13, w13_scale = mxfp4.quantize(_randn(NUM_EXPERTS + 1, 2 * INTER, HIDDEN, seed=5, std=0.2))
    w2, w2_scale = mxfp4.quantize(_randn(NUM_EXPERTS + 1, HIDDEN, INTER, seed=6, std=0.2))
    weights, ids = moe_naive.moe_route(
        _randn(tokens, NUM_EXPERTS, seed=7), _randn(tokens, 1, seed=8), TOP_K, True, NUM_EXPERTS
    )
    experts = dict(w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale)
    return _randn(tokens, HIDDEN, seed=9).to(dtype), weights, ids, experts


def _check_moe(tokens: int, dtype: torch.dtype) -> None:
    x, weights, ids, experts = _moe_case(tokens, dtype)
    got = fused_moe(
        x, topk_weights=weights, topk_ids=ids, weight_format="mxfp4", backend="triton", **experts
    )
    want = moe_naive.fused_moe_mxfp4(
        x, experts["w13"], experts["w2"], weights, ids, experts["w13_scale"], experts["w2_scale"]
    )
    assert got.dtype == dtype
    assert_rel_close(got, want, dtype)


@pytest.mark.parametrize("tokens", [1, 3, 65])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_fused_moe_mxfp4_matches_reference(nan_allocations, tokens, dtype):
    _check_moe(tokens, dtype)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_fused_moe_mxfp4_dot_scaled_matches_reference(nan_allocations, on_gfx950, dtype):
    _check_moe(65, dtype)


@pytest.mark.parametrize(
    "arch,dtype,lhs", [("cuda", BF16, None), ("gfx942", BF16, None), ("gfx950", F32, None)]
)
def test_dot_scaled_is_for_16_bit_activations_on_gfx950_only(monkeypatch, arch, dtype, lhs):
    monkeypatch.setattr(dispatch, "gpu_arch", lambda: arch)
    assert triton_linear.mxfp4_dot_scaled(dtype) is lhs


def test_mxfp4_kernels_reject_weights_with_strided_rows():
    packed, scales = mxfp4.quantize(_randn(24, 64, seed=10))
    # the same shape, its columns apart
    strided = packed.t().contiguous().t()
    with pytest.raises(ValueError, match="contiguous rows"):
        linear(_randn(2, 64, seed=11), strided, scales, weight_format="mxfp4", backend="triton")
    x, weights, ids, experts = _moe_case(3, F32)
    experts["w2"] = experts["w2"].transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="w2 must have contiguous rows"):
        fused_moe(
            x,
            topk_weights=weights,
            topk_ids=ids,
            weight_format="mxfp4",
            backend="triton",
            **experts,
        )
