"""Triton gated delta rule kernels (interpreted on the CPU) against the PyTorch references and transformers."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from sglang_lite.kernels import gated_delta_rule as gdn
from sglang_lite.kernels.gated_delta_rule import naive

from .utils import assert_rel_close

DTYPES = [torch.float32, torch.bfloat16]
HEADS = [(2, 2), (1, 2), (1, 3)]  # (HK, HV): value/key head ratios 1, 2 and 3


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lens).cumsum(0).to(torch.int32)


def _inputs(
    tokens: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, slots: int, seed: int = 0
):
    """q, k, v in dtype; g, beta from the gating of random projections (fp32); a nonzero state pool (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(tokens, hk, dk, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(tokens, hv, dv, generator=gen).to(dtype)
    a, b = torch.randn(tokens, hv, generator=gen), torch.randn(tokens, hv, generator=gen)
    g, beta = naive.fused_gdn_gating(
        torch.rand(hv, generator=gen), a, torch.rand(hv, generator=gen), b
    )
    pool = 0.1 * torch.randn(slots, hv, dk, dv, generator=gen)
    return q, k, v, g, beta, pool


@pytest.mark.parametrize("tokens", [1, 63])
def test_fused_gdn_gating(nan_allocations, tokens):
    gen = torch.Generator().manual_seed(0)
    heads = 3
    ba = 4 * torch.randn(
        tokens, 2 * heads, generator=gen
    )  # b and a are column slices of one projection
    b, a = ba[:, :heads], ba[:, heads:]
    A_log, dt_bias = torch.randn(heads, generator=gen), torch.randn(heads, generator=gen)
    got = gdn.fused_gdn_gating(A_log, a, dt_bias, b, backend="triton")
    want = naive.fused_gdn_gating(A_log, a, dt_bias, b)
    for name, x, y in zip(("g", "beta"), got, want):
        assert x.dtype == torch.float32
        assert_rel_close(x, y, torch.float32, name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hk,hv", HEADS)
@pytest.mark.parametrize("lens", [[1], [63], [64], [65], [300]])
def test_chunk_matches_reference(nan_allocations, dtype, hk, hv, lens):
    q, k, v, g, beta, pool = _inputs(sum(lens), hk, hv, 20, 48, dtype, slots=3)
    slots = torch.tensor([2])
    got_pool, want_pool = pool.clone(), pool.clone()
    got = gdn.chunk_gated_delta_rule(q, k, v, g, beta, got_pool, slots, _cu(lens), backend="triton")
    want = naive.chunk_gated_delta_rule(q, k, v, g, beta, want_pool, slots, _cu(lens))
    assert got.dtype == dtype
    assert_rel_close(got, want, dtype)
    assert_rel_close(
        got_pool, want_pool, dtype, "state pool"
    )  # final state written, other slots untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunk_wide_heads_value_slices(nan_allocations, dtype):
    """dk 96 (padded to 128: the fp32 tile shrinks to 32 tokens) and dv 80 (two value slices, the second partial)."""
    lens = [70, 33]
    q, k, v, g, beta, pool = _inputs(sum(lens), 1, 2, 96, 80, dtype, slots=3, seed=3)
    slots = torch.tensor([2, 0])
    got_pool, want_pool = pool.clone(), pool.clone()
    got = gdn.chunk_gated_delta_rule(q, k, v, g, beta, got_pool, slots, _cu(lens), backend="triton")
    want = naive.chunk_gated_delta_rule(q, k, v, g, beta, want_pool, slots, _cu(lens))
    assert_rel_close(got, want, dtype)
    assert_rel_close(got_pool, want_pool, dtype, "state pool")


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_options_strided_inputs(nan_allocations, chunk_size):
    # dk 48 > dv 20, no in-kernel l2norm, explicit scale, q/k/v as column slices of one packed projection
    tokens, hk, hv, dk, dv = 70, 1, 2, 48, 20
    gen = torch.Generator().manual_seed(1)
    mixed = torch.randn(tokens, 2 * hk * dk + hv * dv, generator=gen)
    q = mixed[:, : hk * dk].view(tokens, hk, dk)
    k = torch.nn.functional.normalize(mixed[:, hk * dk : 2 * hk * dk], dim=-1).view(tokens, hk, dk)
    v = mixed[:, 2 * hk * dk :].view(tokens, hv, dv)
    _, _, _, g, beta, pool = _inputs(tokens, hk, hv, dk, dv, torch.float32, slots=2, seed=2)
    got_pool, want_pool = pool.clone(), pool.clone()
    args = (torch.tensor([1]), _cu([tokens]), 0.3, False)
    got = gdn.chunk_gated_delta_rule(
        q, k, v, g, beta, got_pool, *args, chunk_size, backend="triton"
    )
    want = naive.chunk_gated_delta_rule(q, k, v, g, beta, want_pool, *args)
    assert_rel_close(got, want, torch.float32)
    assert_rel_close(got_pool, want_pool, torch.float32, "state pool")


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_equals_per_request_loop(nan_allocations, dtype):
    lens = [65, 1, 63, 17]
    q, k, v, g, beta, pool = _inputs(sum(lens), 1, 2, 20, 48, dtype, slots=5)
    slots = torch.tensor([4, 1, 3, 2])
    packed_pool, loop_pool = pool.clone(), pool.clone()
    packed = gdn.chunk_gated_delta_rule(
        q, k, v, g, beta, packed_pool, slots, _cu(lens), backend="triton"
    )
    bounds = _cu(lens).tolist()
    pieces = []
    for i, slot in enumerate(slots.tolist()):
        s, e = bounds[i], bounds[i + 1]
        pieces.append(
            gdn.chunk_gated_delta_rule(
                q[s:e],
                k[s:e],
                v[s:e],
                g[s:e],
                beta[s:e],
                loop_pool,
                torch.tensor([slot]),
                _cu([e - s]),
                backend="triton",
            )
        )
    assert_rel_close(packed, torch.cat(pieces), dtype)
    assert_rel_close(packed_pool, loop_pool, dtype, "state pool")
    # and the packed Triton result equals the PyTorch reference over the same batch
    ref_pool = pool.clone()
    assert_rel_close(
        packed, naive.chunk_gated_delta_rule(q, k, v, g, beta, ref_pool, slots, _cu(lens)), dtype
    )
    assert_rel_close(packed_pool, ref_pool, dtype, "state pool")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hk,hv", HEADS)
@pytest.mark.parametrize(
    "slot_ids", [[4, 1, 3], [1, 2, 3]], ids=["scattered", "consecutive"]
)  # gather / in place
def test_recurrent_matches_reference(nan_allocations, dtype, hk, hv, slot_ids):
    q, k, v, g, beta, pool = _inputs(3, hk, hv, 20, 48, dtype, slots=5)
    slots = torch.tensor(slot_ids)
    got_pool, want_pool = pool.clone(), pool.clone()
    got = gdn.fused_recurrent_gated_delta_rule(q, k, v, g, beta, got_pool, slots, backend="triton")
    want = naive.fused_recurrent_gated_delta_rule(q, k, v, g, beta, want_pool, slots)
    assert_rel_close(got, want, dtype)
    assert_rel_close(got_pool, want_pool, dtype, "state pool")


def test_chunked_prefill_equals_token_by_token_decode():
    # two requests of 40 tokens: prefill once (chunks of 16) vs 40 decode steps of both requests together
    steps, hk, hv = 40, 1, 3
    q, k, v, g, beta, pool = _inputs(2 * steps, hk, hv, 20, 48, torch.float32, slots=3)
    slots = torch.tensor([2, 1])
    prefill_pool, decode_pool = pool.clone(), pool.clone()
    prefill = gdn.chunk_gated_delta_rule(
        q, k, v, g, beta, prefill_pool, slots, _cu([steps, steps]), chunk_size=16, backend="triton"
    )
    decoded = torch.empty_like(prefill)
    for t in range(steps):
        rows = torch.tensor([t, steps + t])
        decoded[rows] = gdn.fused_recurrent_gated_delta_rule(
            q[rows], k[rows], v[rows], g[rows], beta[rows], decode_pool, slots, backend="triton"
        )
    assert_rel_close(prefill, decoded, torch.float32)
    assert_rel_close(prefill_pool, decode_pool, torch.float32, "state pool")


def test_errors_name_the_bad_tensor():
    q, k, v, g, beta, pool = _inputs(4, 1, 2, 20, 48, torch.float32, slots=2)
    with pytest.raises(ValueError, match="ssm_states"):
        gdn.chunk_gated_delta_rule(
            q, k, v, g, beta, pool[:, :1], torch.tensor([1]), _cu([4]), backend="triton"
        )
    with pytest.raises(ValueError, match="beta"):
        gdn.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta[:, :1], pool, torch.tensor([0, 1, 0, 1]), backend="triton"
        )
    with pytest.raises(ValueError, match="multiple of key heads"):
        two_heads = q.expand(4, 2, 20)  # 2 key heads cannot serve 3 value heads
        gdn.chunk_gated_delta_rule(
            two_heads,
            two_heads,
            v[:, :1].expand(4, 3, 48),
            g[:, :1].expand(4, 3),
            beta,
            pool,
            torch.tensor([1]),
            _cu([4]),
            backend="triton",
        )


@pytest.mark.parametrize("hk,hv", [(2, 2), (1, 3)])
def test_naive_matches_transformers(hk, hv):
    lens = [70]
    q, k, v, g, beta, pool = _inputs(sum(lens), hk, hv, 20, 48, torch.float32, slots=2)
    ours_pool = pool.clone()
    ours = naive.chunk_gated_delta_rule(q, k, v, g, beta, ours_pool, torch.tensor([1]), _cu(lens))
    hf_args = (q[None], k[None], v[None], g[None], beta[None])
    for hf_fn in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
        hf_out, hf_state = hf_fn(
            *hf_args,
            initial_state=pool[1:2].clone(),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        assert_rel_close(ours, hf_out[0], torch.float32, hf_fn.__name__)
        assert_rel_close(ours_pool[1], hf_state[0], torch.float32, f"{hf_fn.__name__} state")
    decode_pool = pool.clone()
    step = naive.fused_recurrent_gated_delta_rule(
        q[:1], k[:1], v[:1], g[:1], beta[:1], decode_pool, torch.tensor([1])
    )
    hf_step, hf_state = torch_recurrent_gated_delta_rule(
        *(t[:, :1] for t in hf_args),
        initial_state=pool[1:2].clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert_rel_close(step, hf_step[0], torch.float32, "decode step")
    assert_rel_close(decode_pool[1], hf_state[0], torch.float32, "decode state")
