"""Triton RMSNorm kernels (interpreted on the CPU) against the PyTorch references."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Qwen3_5MoeRMSNorm,
    Qwen3_5MoeRMSNormGated,
)

from sglang_lite.kernels import norms
from sglang_lite.kernels.norms import naive, triton_norms

from .utils import assert_rel_close

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16]


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 63, 300])
@pytest.mark.parametrize("dim", [20, 48])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemma_rmsnorm(nan_allocations, dtype, rows, dim, with_residual):
    x, w, r = (
        _randn(rows, dim, dtype=dtype),
        _randn(dim, dtype=dtype, seed=1),
        _randn(rows, dim, dtype=dtype, seed=2),
    )
    residual = r if with_residual else None
    got = norms.gemma_rmsnorm(x, w, EPS, residual, backend="triton")
    want = naive.gemma_rmsnorm(x, w, EPS, residual)
    if with_residual:
        assert_rel_close(got[1], want[1], dtype, "new residual")
        got, want = got[0], want[0]
    assert got.dtype == dtype
    assert_rel_close(got, want, dtype)


class _LaunchCounter:
    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 65])
@pytest.mark.parametrize("q_heads,k_heads,head_dim", [(2, 1, 20), (3, 3, 48)])
def test_fused_qk_one_launch_on_strided_views(
    nan_allocations, monkeypatch, dtype, tokens, q_heads, k_heads, head_dim
):
    # q and k are column slices of one projection output, as after a fused qkv projection: not contiguous
    proj = _randn(tokens, (q_heads + 2 * k_heads) * head_dim, dtype=dtype)
    q, k = (
        proj[:, : q_heads * head_dim],
        proj[:, q_heads * head_dim : (q_heads + k_heads) * head_dim],
    )
    qw, kw = _randn(head_dim, dtype=dtype, seed=1), _randn(head_dim, dtype=dtype, seed=2)
    counter = _LaunchCounter(triton_norms._fused_qk_kernel)
    monkeypatch.setattr(triton_norms, "_fused_qk_kernel", counter)
    q_out, k_out = norms.fused_qk_gemma_rmsnorm(q, k, qw, kw, EPS, head_dim, backend="triton")
    q_want, k_want = naive.fused_qk_gemma_rmsnorm(q, k, qw, kw, EPS, head_dim)
    assert counter.launches == 1
    assert q_out.is_contiguous() and k_out.is_contiguous() and q_out.dtype == dtype
    assert_rel_close(q_out, q_want, dtype, "q")
    assert_rel_close(k_out, k_want, dtype, "k")


def test_fused_qk_head_shaped_and_empty_inputs():
    q, k = _randn(5, 4, 20, dtype=torch.float32), _randn(5, 2, 20, dtype=torch.float32)
    qw, kw = _randn(20, dtype=torch.float32, seed=1), _randn(20, dtype=torch.float32, seed=2)
    for got, want in zip(
        norms.fused_qk_gemma_rmsnorm(q, k, qw, kw, EPS, 20, backend="triton"),
        naive.fused_qk_gemma_rmsnorm(q, k, qw, kw, EPS, 20),
    ):
        assert_rel_close(got, want, torch.float32)
    q_out, k_out = norms.fused_qk_gemma_rmsnorm(q[:0], k[:0], qw, kw, EPS, 20, backend="triton")
    assert q_out.shape == (0, 4, 20) and k_out.shape == (0, 2, 20)


def test_errors_name_the_bad_tensor():
    q, k = torch.randn(3, 40), torch.randn(3, 20)
    with pytest.raises(ValueError, match="k_weight"):
        norms.fused_qk_gemma_rmsnorm(
            q, k, torch.randn(20), torch.randn(16), EPS, 20, backend="triton"
        )
    with pytest.raises(ValueError, match="residual"):
        norms.gemma_rmsnorm(q, torch.randn(40), EPS, torch.randn(2, 40), backend="triton")
    with pytest.raises(ValueError, match="z shape"):
        norms.gated_rmsnorm(q, k, torch.randn(40), EPS, backend="triton")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 63])
def test_gated_rmsnorm(nan_allocations, dtype, tokens):
    heads, dv = 3, 20
    o = _randn(tokens, heads, dv, dtype=dtype)
    z = _randn(tokens, 2 * heads * dv, dtype=dtype, seed=1)[:, heads * dv :].view(
        tokens, heads, dv
    )  # strided
    w = _randn(dv, dtype=dtype, seed=2)
    assert_rel_close(
        norms.gated_rmsnorm(o, z, w, EPS, backend="triton"),
        naive.gated_rmsnorm(o, z, w, EPS),
        dtype,
    )


def test_backend_choice(monkeypatch):
    x, w = torch.randn(4, 20), torch.randn(20)
    calls = []
    monkeypatch.setattr(triton_norms, "gemma_rmsnorm_triton", lambda *a: calls.append("triton"))
    norms.gemma_rmsnorm(x, w, EPS)  # CPU tensors: the PyTorch path
    assert calls == []
    monkeypatch.setenv("SGLANG_KERNEL_BACKEND", "triton")
    norms.gemma_rmsnorm(x, w, EPS)
    assert calls == ["triton"]
    norms.gemma_rmsnorm(x, w, EPS, backend="torch")  # the argument wins over the variable
    assert calls == ["triton"]


def test_backend_errors_name_their_source(monkeypatch):
    x, w = torch.randn(4, 20), torch.randn(20)
    with pytest.raises(ValueError, match="kernel backend argument must be one of .*, got 'cuda'"):
        norms.gemma_rmsnorm(x, w, EPS, backend="cuda")
    monkeypatch.setenv("SGLANG_KERNEL_BACKEND", "cuda")
    with pytest.raises(ValueError, match="SGLANG_KERNEL_BACKEND='cuda' must be one of"):
        norms.gemma_rmsnorm(x, w, EPS)
    norms.gemma_rmsnorm(x, w, EPS, backend="torch")  # an explicit argument never reads the variable
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=1"):
        norms.gemma_rmsnorm(x, w, EPS, backend="triton")


def test_naive_matches_transformers():
    x, w, z = torch.randn(7, 48), torch.randn(48), torch.randn(7, 48)
    hf = Qwen3_5MoeRMSNorm(48, eps=EPS)
    hf_gated = Qwen3_5MoeRMSNormGated(48, eps=EPS)
    with torch.no_grad():
        hf.weight.copy_(w)
        hf_gated.weight.copy_(w)
        assert_rel_close(naive.gemma_rmsnorm(x, w, EPS), hf(x), torch.float32)
        assert_rel_close(naive.gated_rmsnorm(x, z, w, EPS), hf_gated(x, z), torch.float32)
