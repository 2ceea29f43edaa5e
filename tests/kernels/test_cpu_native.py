"""The fused C++ CPU kernels (kernels/cpu) against the PyTorch references, over awkward shapes and strided views.

Their outputs are allocated in C++, out of reach of the NaN poisoning; each case runs twice on fresh inputs of the
same shape instead, so an element left unwritten would hold the first run's value and fail the second comparison.
"""

from __future__ import annotations

import pytest
import torch

from sglang_lite import envs
from sglang_lite.kernels import attention, conv1d, cpu, gated_delta_rule, linear, moe, norms
from sglang_lite.kernels.attention import naive as attention_ref
from sglang_lite.kernels.conv1d import naive as conv_ref
from sglang_lite.kernels.gated_delta_rule import naive as gdn_ref
from sglang_lite.kernels.moe import naive as moe_ref
from sglang_lite.kernels.norms import naive as norm_ref

from .utils import assert_rel_close

F32 = torch.float32
EPS = 1e-6


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    cpu.require()  # the CI machine has g++: a build failure must fail here, not fall back silently


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("shape", [(1, 64), (63, 20), (5, 3, 65), (2, 4, 1, 48)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemma_rmsnorm(seed, shape, with_residual):
    x, residual = _randn(*shape, seed=seed), _randn(*shape, seed=seed + 10)
    weight = _randn(shape[-1], seed=seed + 20)
    got = norms.gemma_rmsnorm(x, weight, EPS, residual if with_residual else None, backend="native")
    want = norm_ref.gemma_rmsnorm(x, weight, EPS, residual if with_residual else None)
    if with_residual:
        assert_rel_close(got[1], want[1], F32, "sum")
        got, want = got[0], want[0]
    assert_rel_close(got, want, F32)


@pytest.mark.parametrize("seed", [0, 1])
def test_qk_rmsnorm_of_strided_heads(seed):
    """q as the attention layer has it: the first half of each head's [q | gate] row."""
    q_gate, k = _randn(7, 4, 2 * 64, seed=seed), _randn(7, 2, 64, seed=seed + 1)
    q = q_gate[..., :64]
    wq, wk = _randn(64, seed=seed + 2), _randn(64, seed=seed + 3)
    assert_rel_close(
        norms.gemma_rmsnorm(q, wq, EPS, backend="native"), norm_ref.gemma_rmsnorm(q, wq, EPS), F32
    )
    got = norms.fused_qk_gemma_rmsnorm(q, k, wq, wk, EPS, 64, backend="native")
    for g, w, name in zip(got, norm_ref.fused_qk_gemma_rmsnorm(q, k, wq, wk, EPS, 64), "qk"):
        assert_rel_close(g, w, F32, name)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("tokens, heads, dim", [(1, 8, 64), (33, 3, 20)])
def test_gated_rmsnorm_with_strided_gate(seed, tokens, heads, dim):
    """z as the GDN layer has it: a column slice of the packed qkvz projection."""
    o = _randn(tokens, heads, dim, seed=seed)
    z = _randn(tokens, 3 * heads * dim, seed=seed + 1)[:, heads * dim : 2 * heads * dim].reshape(
        tokens, heads, dim
    )
    weight = _randn(dim, seed=seed + 2)
    expected = norm_ref.gated_rmsnorm(o, z, weight, EPS)
    assert_rel_close(norms.gated_rmsnorm(o, z, weight, EPS, backend="native"), expected, F32)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("slots", [[3, 4, 5], [7, 0, 2, 5], [1]])
@pytest.mark.parametrize("taps, activation", [(4, "silu"), (2, None)])
def test_conv1d_update(seed, slots, taps, activation):
    dim, pool = 37, 8
    x = _randn(len(slots), 2 * dim, seed=seed)[
        :, :dim
    ]  # strided rows, as a slice of the projection
    weight = _randn(dim, taps, seed=seed + 1)
    states = _randn(pool, dim, taps - 1, seed=seed + 2)
    want_states, indices = states.clone(), torch.tensor(slots)
    got = conv1d.causal_conv1d_update(x, weight, states, indices, activation, backend="native")
    want = conv_ref.causal_conv1d_update(x, weight, want_states, indices, activation)
    assert_rel_close(got, want, F32)
    assert_rel_close(states, want_states, F32, "conv states")


@pytest.mark.parametrize("seed", [0, 1])
def test_gdn_gating(seed):
    ba = _randn(5, 16, seed=seed) * 4  # large |a| reaches softplus's linear branch
    a, b = ba[:, :8], ba[:, 8:]
    A_log, dt_bias = _randn(8, seed=seed + 1), _randn(8, seed=seed + 2)
    got = gated_delta_rule.fused_gdn_gating(A_log, a, dt_bias, b, backend="native")
    for g, w, name in zip(got, gdn_ref.fused_gdn_gating(A_log, a, dt_bias, b), ("g", "beta")):
        assert_rel_close(g, w, F32, name)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("slots", [[2, 3, 4, 5], [6, 1, 3], [0]])
@pytest.mark.parametrize("hk, hv, dk, dv", [(2, 4, 32, 48), (4, 4, 16, 16), (1, 3, 24, 8)])
@pytest.mark.parametrize("l2norm", [True, False])
def test_recurrent_gated_delta_rule(seed, slots, hk, hv, dk, dv, l2norm):
    """q, k, v as views of the conv output [B, 2 HK dk + HV dv]; GQA; final states compared too."""
    batch, pool = len(slots), 8
    qkv = _randn(batch, 2 * hk * dk + hv * dv, seed=seed)
    q = qkv[:, : hk * dk].view(batch, hk, dk)
    k = qkv[:, hk * dk : 2 * hk * dk].view(batch, hk, dk)
    v = qkv[:, 2 * hk * dk :].view(batch, hv, dv)
    g, beta = (
        -torch.rand(batch, hv, generator=_gen(seed + 1)),
        torch.rand(batch, hv, generator=_gen(seed + 2)),
    )
    states = _randn(pool, hv, dk, dv, seed=seed + 3)
    want_states, indices = states.clone(), torch.tensor(slots)
    got = gated_delta_rule.fused_recurrent_gated_delta_rule(
        q, k, v, g, beta, states, indices, None, l2norm, backend="native"
    )
    want = gdn_ref.fused_recurrent_gated_delta_rule(
        q, k, v, g, beta, want_states, indices, None, l2norm
    )
    assert_rel_close(got, want, F32)
    assert_rel_close(states, want_states, F32, "ssm states")


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "lens, slots", [([130], [3]), ([5, 37, 1, 64], [6, 1, 3, 2]), ([2, 0, 9], [4, 5, 1])]
)
@pytest.mark.parametrize("hk, hv, dk, dv", [(2, 4, 32, 48), (4, 8, 64, 64), (1, 3, 20, 136)])
@pytest.mark.parametrize("l2norm", [True, False])
def test_chunk_gated_delta_rule(seed, lens, slots, hk, hv, dk, dv, l2norm):
    """The token-by-token prefill against the chunked reference: packed requests of any length (an empty one
    included) continuing from non-zero pooled states, q, k, v as views of the conv output, GQA, column counts that
    leave 64- and 16-wide blocks and a scalar tail; outputs and final states."""
    tokens, pool = sum(lens), 8
    qkv = _randn(tokens, 2 * hk * dk + hv * dv, seed=seed)
    if (
        not l2norm
    ):  # keys of about unit norm, as a model gives it: with |k|^2 ~ dk the recurrence is unstable
        qkv[:, : 2 * hk * dk] /= dk**0.5
    q = qkv[:, : hk * dk].view(tokens, hk, dk)
    k = qkv[:, hk * dk : 2 * hk * dk].view(tokens, hk, dk)
    v = qkv[:, 2 * hk * dk :].view(tokens, hv, dv)
    g = -2 * torch.rand(tokens, hv, generator=_gen(seed + 1))
    beta = torch.rand(tokens, hv, generator=_gen(seed + 2))
    states = _randn(pool, hv, dk, dv, seed=seed + 3) / 4
    want_states, indices = states.clone(), torch.tensor(slots)
    got = gated_delta_rule.chunk_gated_delta_rule(
        q, k, v, g, beta, states, indices, _cu(lens), None, l2norm, backend="native"
    )
    want = gdn_ref.chunk_gated_delta_rule(
        q, k, v, g, beta, want_states, indices, _cu(lens), None, l2norm
    )
    assert_rel_close(got, want, F32)
    assert_rel_close(states, want_states, F32, "ssm states")


def test_chunk_gated_delta_rule_then_decode_is_one_prefill():
    """A prompt prefilled in two pieces, then decoded, leaves the state and outputs of one whole prefill."""
    hk, hv, dk, dv, steps = 2, 4, 32, 32, 23
    q, k = _randn(steps, hk, dk, seed=0), _randn(steps, hk, dk, seed=1)
    v, g = _randn(steps, hv, dv, seed=2), -torch.rand(steps, hv, generator=_gen(3))
    beta = torch.rand(steps, hv, generator=_gen(4))
    whole_pool, split_pool, slot = (
        torch.zeros(2, hv, dk, dv),
        torch.zeros(2, hv, dk, dv),
        torch.tensor([1]),
    )
    whole = gated_delta_rule.chunk_gated_delta_rule(
        q, k, v, g, beta, whole_pool, slot, _cu([steps]), backend="native"
    )
    pieces = [
        gated_delta_rule.chunk_gated_delta_rule(
            *(t[a:b] for t in (q, k, v, g, beta)), split_pool, slot, _cu([b - a]), backend="native"
        )
        for a, b in ((0, 9), (9, 22))
    ]
    pieces.append(
        gated_delta_rule.fused_recurrent_gated_delta_rule(
            *(t[22:] for t in (q, k, v, g, beta)), split_pool, slot, backend="native"
        )
    )
    assert_rel_close(torch.cat(pieces), whole, F32)
    assert_rel_close(split_pool, whole_pool, F32, "ssm states")


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "lens, slots", [([128, 128], [2, 5]), ([1, 2, 7, 40], [3, 1, 6, 2]), ([1, 3], [4, 1])]
)
@pytest.mark.parametrize("dim", [37, 300])
@pytest.mark.parametrize("taps, activation", [(4, "silu"), (2, None), (5, "silu")])
def test_causal_conv1d_prefill(seed, lens, slots, dim, taps, activation):
    """Packed requests, some shorter than the kernel (they keep part of their old state), strided rows."""
    tokens, pool = sum(lens), 8
    x = _randn(tokens, 2 * dim, seed=seed)[:, :dim]
    weight = _randn(dim, taps, seed=seed + 1)
    states = _randn(pool, dim, taps - 1, seed=seed + 2)
    want_states, indices = states.clone(), torch.tensor(slots)
    got = conv1d.causal_conv1d_fn(
        x, weight, states, indices, _cu(lens), activation, backend="native"
    )
    want = conv_ref.causal_conv1d_fn(x, weight, want_states, indices, _cu(lens), activation)
    assert_rel_close(got, want, F32)
    assert_rel_close(states, want_states, F32, "conv states")


def test_bad_cu_seqlens_is_an_error_naming_it():
    x, states = torch.zeros(4, 8), torch.zeros(3, 8, 3)
    with pytest.raises(
        RuntimeError, match=r"cu_seqlens must run from 0 to the 4 tokens, got 0 to 3"
    ):
        conv1d.causal_conv1d_fn(
            x, torch.zeros(8, 4), states, torch.tensor([1]), _cu([3]), backend="native"
        )
    with pytest.raises(RuntimeError, match=r"cu_seqlens must hold 3 entries"):
        conv1d.causal_conv1d_fn(
            x, torch.zeros(8, 4), states, torch.tensor([1, 2]), _cu([4]), backend="native"
        )


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("heads, kv_heads, hd", [(8, 2, 64), (4, 4, 16), (6, 2, 72)])
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_decode_attention(seed, heads, kv_heads, hd, table_dtype, page_size):
    pool, rows, context = 640, 6, 80
    k_cache, v_cache = (
        _randn(pool, kv_heads, hd, seed=seed),
        _randn(pool, kv_heads, hd, seed=seed + 1),
    )
    pages = context // page_size
    table = (
        torch.randperm(pool // page_size, generator=_gen(seed + 2))[: rows * pages]
        .view(rows, pages)
        .to(table_dtype)
    )
    req_rows, seq_lens = torch.tensor([4, 0, 5, 2]), torch.tensor([1, 80, 17, 64])
    q = _randn(4, heads, hd, seed=seed + 3)
    args = (q, k_cache, v_cache, table, req_rows, seq_lens, hd**-0.5)
    got = attention.decode_attention(*args, page_size=page_size, backend="native")
    want = attention_ref.decode_attention(*args, page_size=page_size)
    assert_rel_close(got, want, F32)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("heads, kv_heads, hd", [(8, 2, 64), (4, 4, 16), (6, 2, 72)])
@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_extend_attention(seed, heads, kv_heads, hd, page_size):
    """A prefill's new tokens over their requests' cached prefixes and themselves, causally: requests with and
    without a prefix, of one token and of more than a block of queries (32), packed one after another."""
    pool, rows, context = 640, 6, 80
    k_cache, v_cache = (
        _randn(pool, kv_heads, hd, seed=seed),
        _randn(pool, kv_heads, hd, seed=seed + 1),
    )
    pages = context // page_size
    table = torch.randperm(pool // page_size, generator=_gen(seed + 2))[: rows * pages]
    table = table.view(rows, pages).to(torch.int32)
    req_rows = torch.tensor([4, 0, 5, 2])
    prefix, extend = torch.tensor([0, 7, 40, 0]), torch.tensor([1, 33, 3, 70])
    q = _randn(int(extend.sum()), heads, hd, seed=seed + 3)
    args = (q, k_cache, v_cache, table, req_rows, prefix, extend, hd**-0.5)
    got = cpu.extend_attention(*args, page_size=page_size)
    want = attention_ref.extend_attention(*args, page_size)
    assert_rel_close(got, want, F32)


def test_extend_attention_refuses_lengths_that_do_not_add_up():
    k_cache = torch.zeros(64, 1, 8)
    table = torch.arange(64, dtype=torch.int32).view(1, 64)
    args = (torch.zeros(5, 2, 8), k_cache, k_cache, table, torch.tensor([0]), torch.tensor([3]))
    with pytest.raises(RuntimeError, match=r"extend_lens sum to 4, the queries hold 5 tokens"):
        cpu.extend_attention(*args, torch.tensor([4]), 1.0)
    with pytest.raises(RuntimeError, match=r"outside the KV pool"):
        cpu.extend_attention(*args[:3], table + 60, *args[4:], torch.tensor([5]), 1.0)


def _transposed_memory(w: torch.Tensor) -> torch.Tensor:
    """The same values stored [in, out], as weight_layout stores wide projections on the CPU."""
    return w.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("tokens", [1, 5, 33])
@pytest.mark.parametrize("layout", ["out_in", "in_out"])
@pytest.mark.parametrize("hidden, inter", [(72, 40), (258, 64)])
def test_fused_moe(seed, tokens, layout, hidden, inter):
    """Top-k routed experts plus an always-selected shared one (id E - 1), as the fused shared expert runs; widths
    around the kernel's column blocks (128-column runs of one-row experts included) and depths off a multiple of 4."""
    experts, top_k = 9, 3
    w13, w2 = (
        _randn(experts, 2 * inter, hidden, seed=seed) / 8,
        _randn(experts, hidden, inter, seed=seed + 1) / 8,
    )
    if layout == "in_out":
        w13, w2 = _transposed_memory(w13), _transposed_memory(w2)
    x = _randn(tokens, hidden, seed=seed + 2)
    routed = torch.stack(
        [torch.randperm(experts - 1, generator=_gen(seed + t))[: top_k - 1] for t in range(tokens)]
    )
    ids = torch.cat([routed, torch.full((tokens, 1), experts - 1)], dim=1).to(torch.int32)
    weights = torch.rand(tokens, top_k, generator=_gen(seed + 3))
    got = moe.fused_moe(x, w13, w2, weights, ids, backend="native")
    assert_rel_close(got, moe_ref.fused_moe(x, w13, w2, weights, ids), F32)


def _input_major(w: torch.Tensor) -> torch.Tensor:
    """An [N, K] weight as weight_layout stores it: a view of [K, N] memory."""
    return w.t().contiguous().t()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("rows", [1, 3, 8, 33, 256])
@pytest.mark.parametrize("columns", [16, 17, 48, 300, 544])
@pytest.mark.parametrize("depth", [7, 64, 100])
@pytest.mark.parametrize("layout", ["in_out", "out_in"])
def test_linear(seed, rows, columns, depth, layout):
    """Row counts around the kernel's blocks of 8 rows, widths around its 512-, 128-, 32- and 16-column blocks and
    a scalar tail, both weight layouts (the kernel itself takes either at any row count); x with strided rows (a
    slice of a wider activation)."""
    x = _randn(rows, depth + 5, seed=seed)[:, 2 : 2 + depth]
    weight = _randn(columns, depth, seed=seed + 1)
    weight = _input_major(weight) if layout == "in_out" else weight
    got = cpu.linear(x, weight)
    assert_rel_close(got, torch.nn.functional.linear(x, weight), F32)


def test_linear_takes_only_what_it_serves():
    """Fewer than 16 columns, more rows than a layout's limit and weights contiguous along neither dimension go to
    F.linear; leading dimensions of x are kept."""
    weight = _input_major(_randn(40, 24, seed=0))
    assert cpu.takes_linear(_randn(5, 24, seed=1), weight)
    assert cpu.takes_linear(_randn(5, 24, seed=1), weight.contiguous())
    assert not cpu.takes_linear(
        _randn(cpu.LINEAR_MAX_ROWS_OUT_IN + 1, 24, seed=1), weight.contiguous()
    )
    assert not cpu.takes_linear(
        _randn(5, 24, seed=1), _randn(40, 48, seed=4)[:, ::2]
    )  # strides (48, 2)
    assert not cpu.takes_linear(_randn(5, 24, seed=1), _input_major(_randn(15, 24, seed=2)))
    assert not cpu.takes_linear(_randn(cpu.LINEAR_MAX_ROWS + 1, 24, seed=1), weight)
    x = _randn(2, 3, 24, seed=3)
    assert_rel_close(linear(x, weight), torch.nn.functional.linear(x, weight), F32)


def test_fused_moe_with_experts_of_many_rows():
    """A prefill's experts of 128 rows or more run as GEMMs (MKL's), the others in the kernel's own loops."""
    experts, hidden, inter, top_k, tokens = 5, 40, 24, 2, 300
    w13 = _transposed_memory(_randn(experts, 2 * inter, hidden, seed=0) / 8)
    w2 = _transposed_memory(_randn(experts, hidden, inter, seed=1) / 8)
    x = _randn(tokens, hidden, seed=2)
    ids = torch.stack([torch.tensor([t % 2, 2 + t % 3]) for t in range(tokens)]).to(
        torch.int32
    )  # 150, 150, 100...
    ids[:7, 1] = 4  # and one expert of 7 rows
    weights = torch.rand(tokens, top_k, generator=_gen(3))
    got = moe.fused_moe(x, w13, w2, weights, ids, backend="native")
    assert_rel_close(got, moe_ref.fused_moe(x, w13, w2, weights, ids), F32)


def test_fused_moe_in_token_chunks(monkeypatch):
    """A prefill's tokens run in chunks of MOE_CHUNK_TOKENS (here 16: 40 tokens in 16 + 16 + 8)."""
    monkeypatch.setattr(cpu, "MOE_CHUNK_TOKENS", 16)
    experts, hidden, inter, top_k, tokens = 6, 48, 32, 2, 40
    w13 = _transposed_memory(_randn(experts, 2 * inter, hidden, seed=0) / 8)
    w2 = _transposed_memory(_randn(experts, hidden, inter, seed=1) / 8)
    x = _randn(tokens, hidden, seed=2)
    ids = torch.stack(
        [torch.randperm(experts, generator=_gen(t))[:top_k] for t in range(tokens)]
    ).to(torch.int32)
    weights = torch.rand(tokens, top_k, generator=_gen(3))
    got = moe.fused_moe(x, w13, w2, weights, ids, backend="native")
    assert_rel_close(got, moe_ref.fused_moe(x, w13, w2, weights, ids), F32)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 16, 4), (33, 8, 2), (5, 3, 3)])
@pytest.mark.parametrize("shared, renormalize", [(True, True), (False, True), (False, False)])
def test_moe_route(seed, tokens, experts, top_k, shared, renormalize):
    """Routing weights and ids against the reference (softmax, top-k, renormalisation, the shared expert's
    column); router logits as a strided view."""
    logits = _randn(tokens, experts + 3, seed=seed)[:, :experts] * 3
    shared_logits = _randn(tokens, 1, seed=seed + 1) if shared else None
    got = moe.moe_route(logits, shared_logits, top_k, renormalize, experts, backend="native")
    want = moe_ref.moe_route(logits, shared_logits, top_k, renormalize, experts)
    assert torch.equal(got[1], want[1]) and got[1].dtype == torch.int32
    assert_rel_close(got[0], want[0], F32)


def test_bad_slot_is_an_error_naming_it():
    states = torch.zeros(4, 8, 3)
    with pytest.raises(
        RuntimeError, match=r"state_indices\[1\] = 9 is outside the pool of 4 slots"
    ):
        conv1d.causal_conv1d_update(
            torch.zeros(2, 8), torch.zeros(8, 4), states, torch.tensor([0, 9]), backend="native"
        )


def test_bad_expert_id_is_an_error_naming_it():
    with pytest.raises(RuntimeError, match=r"topk_ids\[0\] = 5 is outside the pool of 4"):
        moe.fused_moe(
            torch.zeros(1, 8),
            torch.zeros(4, 6, 8),
            torch.zeros(4, 8, 3),
            torch.ones(1, 1),
            torch.tensor([[5]], dtype=torch.int32),
            backend="native",
        )


def test_dispatch(monkeypatch):
    """auto takes the C++ kernels for float32 CPU data; torch and other dtypes take the references."""
    x, w = _randn(3, 16, seed=0), _randn(16, seed=1)
    calls = []
    real = cpu.gemma_rmsnorm
    monkeypatch.setattr(cpu, "gemma_rmsnorm", lambda *a: calls.append(a) or real(*a))
    norms.gemma_rmsnorm(x, w, EPS)
    assert len(calls) == 1
    norms.gemma_rmsnorm(x, w, EPS, backend="torch")
    norms.gemma_rmsnorm(x.bfloat16(), w.bfloat16(), EPS, backend="native")
    monkeypatch.setenv("SGLANG_KERNEL_BACKEND", "torch")
    norms.gemma_rmsnorm(x, w, EPS)
    assert len(calls) == 1
    monkeypatch.setenv("SGLANG_KERNEL_BACKEND", "native")
    assert envs.SGLANG_KERNEL_BACKEND.get() == "native"
    norms.gemma_rmsnorm(x, w, EPS)
    assert len(calls) == 2
