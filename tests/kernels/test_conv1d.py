"""Triton causal conv1d kernels (interpreted on the CPU) against the PyTorch references."""

from __future__ import annotations

import pytest
import torch

from sglang_lite.kernels import conv1d
from sglang_lite.kernels.conv1d import naive

from .utils import assert_rel_close

DTYPES = [torch.float32, torch.bfloat16]
K = 4


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lens).cumsum(0).to(torch.int32)


def _inputs(tokens: int, dim: int, slots: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=gen).to(dtype)
    weight = torch.randn(dim, K, generator=gen).to(dtype)
    pool = torch.randn(slots, dim, K - 1, generator=gen).to(
        dtype
    )  # nonzero: every request continues a prefix
    return x, weight, pool


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens", [[1], [63], [64], [65], [300], [2, 65, 1, 17]])
@pytest.mark.parametrize("dim", [20, 48])
def test_causal_conv1d_fn(nan_allocations, dtype, lens, dim):
    x, weight, pool = _inputs(sum(lens), dim, len(lens) + 2, dtype)
    slots = torch.arange(
        len(lens) + 1, 1, -1
    )  # reversed, skipping slot 0: the kernel must follow the indices
    got_pool, want_pool = pool.clone(), pool.clone()
    got = conv1d.causal_conv1d_fn(x, weight, got_pool, slots, _cu(lens), backend="triton")
    want = naive.causal_conv1d_fn(x, weight, want_pool, slots, _cu(lens))
    assert_rel_close(got, want, dtype)
    assert_rel_close(
        got_pool, want_pool, dtype, "conv state pool"
    )  # final states, untouched slots unchanged


def test_packed_equals_per_request_loop():
    lens = [5, 65, 1]
    x, weight, pool = _inputs(sum(lens), 20, 4, torch.float32)
    packed_pool, loop_pool = pool.clone(), pool.clone()
    packed = conv1d.causal_conv1d_fn(
        x, weight, packed_pool, torch.tensor([1, 2, 3]), _cu(lens), None, backend="triton"
    )
    pieces = []
    for i, (start, length) in enumerate(zip(_cu(lens)[:-1].tolist(), lens)):
        pieces.append(
            conv1d.causal_conv1d_fn(
                x[start : start + length],
                weight,
                loop_pool,
                torch.tensor([i + 1]),
                _cu([length]),
                None,
                backend="triton",
            )
        )
    assert_rel_close(packed, torch.cat(pieces), torch.float32)
    assert_rel_close(packed_pool, loop_pool, torch.float32, "conv state pool")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(
    "consecutive", [False, True]
)  # the reference updates a run of slots in place
def test_causal_conv1d_update(nan_allocations, dtype, batch, consecutive):
    x, weight, pool = _inputs(batch, 48, batch + 2, dtype)
    slots = torch.arange(2, batch + 2) if consecutive else torch.arange(batch + 1, 1, -1)
    got_pool, want_pool = pool.clone(), pool.clone()
    got = conv1d.causal_conv1d_update(x, weight, got_pool, slots, backend="triton")
    want = naive.causal_conv1d_update(x, weight, want_pool, slots)
    assert_rel_close(got, want, dtype)
    assert_rel_close(got_pool, want_pool, dtype, "conv state pool")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_prefill_then_decode_equals_longer_prefill(backend):
    x, weight, pool = _inputs(9, 20, 2, torch.float32)
    decode_pool, prefill_pool = pool.clone(), pool.clone()
    slot = torch.tensor([1])
    outs = [conv1d.causal_conv1d_fn(x[:6], weight, decode_pool, slot, _cu([6]), backend=backend)]
    for t in range(6, 9):
        outs.append(
            conv1d.causal_conv1d_update(x[t : t + 1], weight, decode_pool, slot, backend=backend)
        )
    whole = conv1d.causal_conv1d_fn(x, weight, prefill_pool, slot, _cu([9]), backend=backend)
    assert_rel_close(torch.cat(outs), whole, torch.float32)
    assert_rel_close(decode_pool, prefill_pool, torch.float32, "conv state pool")


def test_errors_name_the_bad_tensor():
    x, weight, pool = _inputs(4, 20, 2, torch.float32)
    with pytest.raises(ValueError, match="conv_states"):
        conv1d.causal_conv1d_fn(
            x, weight, pool[:, :, :2], torch.tensor([1]), _cu([4]), backend="triton"
        )
    with pytest.raises(ValueError, match="cu_seqlens"):
        conv1d.causal_conv1d_fn(x, weight, pool, torch.tensor([1]), _cu([2, 2]), backend="triton")
