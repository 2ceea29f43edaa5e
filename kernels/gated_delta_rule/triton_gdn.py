"""Triton gated delta rule: gating, chunked prefill over packed requests, recurrent decode.

Layouts as in ``naive.py``: q, k [T, HK, dk]; v [T, HV, dv]; g, beta [T, HV]; state pool [S, HV, dk, dv].
Head dims need not be powers of two: tiles are padded (to at least 16, the smallest ``tl.dot`` size) and masked.

Prefill design: one program per (request, value head, slice of up to 64 value columns) walks the request chunk by
chunk, keeping its [dk, 64] part of the state in registers. Inside a chunk of BT tokens (cumulative log-decay c,
decay D_ij = exp(c_i - c_j) for j <= i):
  A = strictly_lower(diag(beta) K K^T * D);  T = (I + A)^-1 by forward substitution (the UT transform);
  U = T diag(beta) V;  W = T diag(beta exp(c)) K;  V' = U - W S;
  O = diag(exp(c)) Q S + (Q K^T * D) V';  S <- exp(c_last) S + (diag(exp(c_last - c)) K)^T V'.
This is exactly the token recurrence regrouped, so chunked prefill and token-by-token decode agree (to rounding).

Batch invariance (``kernels/batch_invariant.py``) needs the same bits, not agreement: the chunks start where each
call's tokens start, so a prompt prefilled in two chunks, or resumed from a prefix-cache hit, regroups its sums.
There prefill runs the decode kernel over each request's tokens in turn (``recurrent_prefill_triton``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import dispatch
from ..dispatch import dot_precision


@triton.jit
def _l2norm_rows(x):
    """Rows over the last axis, eps 1e-6 as in the reference l2norm (and FLA's)."""
    return x * tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) + 1e-6)


@triton.jit
def _gdn_gating_kernel(
    A_log_ptr,
    a_ptr,
    dt_bias_ptr,
    b_ptr,
    g_ptr,
    beta_ptr,
    n_rows,
    stride_a,
    stride_b,
    H: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    heads = tl.arange(0, BLOCK_H)
    mask = (rows < n_rows)[:, None] & (heads < H)[None, :]
    a = tl.load(a_ptr + rows[:, None] * stride_a + heads[None, :], mask=mask, other=0.0).to(
        tl.float32
    )
    b = tl.load(b_ptr + rows[:, None] * stride_b + heads[None, :], mask=mask, other=0.0).to(
        tl.float32
    )
    A_log = tl.load(A_log_ptr + heads, mask=heads < H, other=0.0).to(tl.float32)
    x = a + tl.load(dt_bias_ptr + heads, mask=heads < H, other=0.0).to(tl.float32)[None, :]
    # softplus with PyTorch's threshold: linear above 20, where exp would only add rounding error
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    out = rows[:, None] * H + heads[None, :]
    tl.store(g_ptr + out, -tl.exp(A_log)[None, :] * softplus, mask=mask)
    tl.store(beta_ptr + out, tl.sigmoid(b), mask=mask)


@triton.jit
def _recurrent_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    out_ptr,
    states_ptr,
    slots_ptr,
    cu_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_ss,
    stride_sh,
    stride_sk,
    scale,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """The recurrence token by token for (request, value head, dv block): a decode step's one token, or with
    ``VARLEN`` the request's tokens cu[req]:cu[req + 1] one after another, the same arithmetic per token (the
    state rounded to the pool's dtype after each, as a decode step stores it). The pooled state block is updated
    in place."""
    req = tl.program_id(0)
    hv = tl.program_id(1)
    vblock = tl.program_id(2)
    hk = hv // GROUP
    if VARLEN:
        start = tl.load(cu_ptr + req).to(tl.int64)
        end = tl.load(cu_ptr + req + 1).to(tl.int64)
    else:
        start = req.to(tl.int64)
        end = start + 1
    ks = tl.arange(0, BK)
    vs = vblock * BV + tl.arange(0, BV)
    slot = tl.load(slots_ptr + req).to(tl.int64)
    s_ptrs = states_ptr + slot * stride_ss + hv * stride_sh + ks[:, None] * stride_sk + vs[None, :]
    s_mask = (ks < DK)[:, None] & (vs < DV)[None, :]
    state = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
    for tok in range(start, end):
        q = tl.load(q_ptr + tok * stride_qt + hk * stride_qh + ks, mask=ks < DK, other=0.0)
        k = tl.load(k_ptr + tok * stride_kt + hk * stride_kh + ks, mask=ks < DK, other=0.0)
        q, k = q.to(tl.float32), k.to(tl.float32)
        v = tl.load(v_ptr + tok * stride_vt + hv * stride_vh + vs, mask=vs < DV, other=0.0)
        v = v.to(tl.float32)
        if L2NORM:
            q, k = _l2norm_rows(q), _l2norm_rows(k)
        q = q * scale
        g = tl.load(g_ptr + tok * stride_gt + hv).to(tl.float32)
        beta = tl.load(beta_ptr + tok * stride_bt + hv).to(tl.float32)
        state = state * tl.exp(g)
        delta = beta * (v - tl.sum(state * k[:, None], axis=0))
        state += k[:, None] * delta[None, :]
        o = tl.sum(state * q[:, None], axis=0)
        tl.store(
            out_ptr + tok * stride_ot + hv * stride_oh + vs,
            o.to(out_ptr.dtype.element_ty),
            mask=vs < DV,
        )
        state = state.to(states_ptr.dtype.element_ty).to(tl.float32)
    tl.store(s_ptrs, state.to(states_ptr.dtype.element_ty), mask=s_mask)


@triton.jit
def _unit_lower_inverse(A, BT: tl.constexpr, LOG2_BT: tl.constexpr, PRECISION: tl.constexpr):
    """(I + A)^-1 for strictly lower-triangular A [BT, BT] by block doubling.

    ``inv`` holds the inverse of the block-diagonal part of I + A with blocks of size s; merging pairs of blocks,
    [[X11, 0], [X21, X22]]^-1 = [[T11, 0], [-T22 X21 T11, T22]], is inv - inv (A on the X21 blocks) inv.
    log2(BT) rounds of two dots, and no powers of A (which would lose accuracy when keys repeat).
    """
    rows = tl.arange(0, BT)
    inv = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for level in tl.static_range(LOG2_BT):
        pair = (rows[:, None] >> (level + 1)) == (rows[None, :] >> (level + 1))
        cross = pair & ((rows[:, None] >> level) != (rows[None, :] >> level))
        x21 = tl.dot(tl.where(cross, A, 0.0), inv, input_precision=PRECISION)
        inv = inv - tl.dot(inv, x21, input_precision=PRECISION)
    return inv


@triton.jit
def _load_chunk(ptr, tok, stride_t, cols, valid, N: tl.constexpr):
    mask = valid[:, None] & (cols < N)[None, :]
    return tl.load(ptr + tok[:, None] * stride_t + cols[None, :], mask=mask, other=0.0).to(
        tl.float32
    )


@triton.jit
def _chunk_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    out_ptr,
    states_ptr,
    slots_ptr,
    cu_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_ss,
    stride_sh,
    stride_sk,
    scale,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    LOG2_BT: tl.constexpr,
    L2NORM: tl.constexpr,
    PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    hv = tl.program_id(1)
    vblock = tl.program_id(2)
    hk = hv // GROUP
    start = tl.load(cu_ptr + req)
    length = tl.load(cu_ptr + req + 1) - start
    ks = tl.arange(0, BK)
    vs = vblock * BV + tl.arange(0, BV)
    ts = tl.arange(0, BT)
    s_ptrs = (
        states_ptr
        + tl.load(slots_ptr + req).to(tl.int64) * stride_ss
        + hv * stride_sh
        + ks[:, None] * stride_sk
        + vs[None, :]
    )
    s_mask = (ks < DK)[:, None] & (vs < DV)[None, :]
    state = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
    causal = ts[:, None] >= ts[None, :]
    q_base, k_base = q_ptr + hk * stride_qh, k_ptr + hk * stride_kh
    for t0 in range(0, length, BT):
        valid = t0 + ts < length
        tok = (start + t0 + ts).to(tl.int64)
        q = _load_chunk(q_base, tok, stride_qt, ks, valid, DK)
        k = _load_chunk(k_base, tok, stride_kt, ks, valid, DK)
        v = _load_chunk(v_ptr + hv * stride_vh, tok, stride_vt, vs, valid, DV)
        g = tl.load(g_ptr + tok * stride_gt + hv, mask=valid, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + tok * stride_bt + hv, mask=valid, other=0.0).to(tl.float32)
        if L2NORM:
            q, k = _l2norm_rows(q), _l2norm_rows(k)
        q = q * scale
        # padded tokens have g = 0, so the last cumulative decay is that of the last real token
        c = tl.cumsum(g, axis=0)
        c_last = tl.sum(tl.where(ts == BT - 1, c, 0.0), axis=0)
        decay = tl.where(causal, tl.exp(tl.where(causal, c[:, None] - c[None, :], 0.0)), 0.0)
        kkt = tl.dot(k, tl.trans(k), input_precision=PRECISION)
        A = tl.where(ts[:, None] > ts[None, :], kkt * decay * beta[:, None], 0.0)
        inv = _unit_lower_inverse(A, BT, LOG2_BT, PRECISION)
        u = tl.dot(inv, v * beta[:, None], input_precision=PRECISION)
        w = tl.dot(inv, k * (beta * tl.exp(c))[:, None], input_precision=PRECISION)
        v_new = u - tl.dot(w, state, input_precision=PRECISION)
        attn = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay
        o = tl.dot(q * tl.exp(c)[:, None], state, input_precision=PRECISION)
        o += tl.dot(attn, v_new, input_precision=PRECISION)
        o_mask = valid[:, None] & (vs < DV)[None, :]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + hv * stride_oh + vs[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=o_mask,
        )
        k_to_end = k * tl.exp(c_last - c)[:, None]
        state = state * tl.exp(c_last) + tl.dot(
            tl.trans(k_to_end), v_new, input_precision=PRECISION
        )
    tl.store(s_ptrs, state.to(states_ptr.dtype.element_ty), mask=s_mask)


# ---------------------------------------------------------------------------------------------------- launchers


def _check_last_contiguous(t: torch.Tensor, name: str, dims: int) -> None:
    if t.dim() != dims or t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be {dims}-D with a contiguous last dim, "
            f"got {tuple(t.shape)} strides {t.stride()}"
        )


def _pad(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def fused_gdn_gating_triton(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    h = a.shape[-1]
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t.shape != (h,) or t.stride(0) != 1:
            raise ValueError(f"{name} must be a contiguous [{h}] tensor, got {tuple(t.shape)}")
    if b.shape != a.shape:
        raise ValueError(f"b shape {tuple(b.shape)} must match a shape {tuple(a.shape)}")
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("a and b need a contiguous last dim (heads)")
    a2, b2 = a.reshape(-1, h), b.reshape(-1, h)
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    rows = a2.shape[0]
    if rows:
        _gdn_gating_kernel[(triton.cdiv(rows, 32),)](
            A_log_ptr=A_log,
            a_ptr=a2,
            dt_bias_ptr=dt_bias,
            b_ptr=b2,
            g_ptr=g,
            beta_ptr=beta,
            n_rows=rows,
            stride_a=a2.stride(0),
            stride_b=b2.stride(0),
            H=h,
            ROWS=32,
            BLOCK_H=triton.next_power_of_2(h),
        )
    return g, beta


class _GdnDims(NamedTuple):
    """Key heads, value heads, key head dim and value head dim of one call."""

    hk: int
    hv: int
    dk: int
    dv: int


def _check_gdn_inputs(q, k, v, g, beta, ssm_states, state_indices) -> _GdnDims:
    """Validate shapes and strides; returns the head counts and dims."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_last_contiguous(t, name, 3)
    if q.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape")
    tokens = k.shape[0]
    hk, dk = k.shape[1:]
    hv, dv = v.shape[1:]
    if v.shape[0] != tokens:
        raise ValueError(f"v has {v.shape[0]} tokens, q/k have {tokens}")
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
    for name, t in (("g", g), ("beta", beta)):
        _check_last_contiguous(t, name, 2)
        if t.shape != (tokens, hv):
            raise ValueError(f"{name} must be [{tokens}, {hv}], got {tuple(t.shape)}")
    if ssm_states.dim() != 4 or ssm_states.shape[1:] != (hv, dk, dv) or ssm_states.stride(3) != 1:
        raise ValueError(
            f"ssm_states must be [slots, {hv}, {dk}, {dv}] with a contiguous last dim, "
            f"got {tuple(ssm_states.shape)}"
        )
    if state_indices.dim() != 1 or state_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"state_indices must be a 1-D integer tensor, "
            f"got {tuple(state_indices.shape)} {state_indices.dtype}"
        )
    return _GdnDims(hk, hv, dk, dv)


def _strides(q, k, v, g, beta, out, ssm_states) -> dict[str, int]:
    return dict(
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_kt=k.stride(0),
        stride_kh=k.stride(1),
        stride_vt=v.stride(0),
        stride_vh=v.stride(1),
        stride_gt=g.stride(0),
        stride_bt=beta.stride(0),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_ss=ssm_states.stride(0),
        stride_sh=ssm_states.stride(1),
        stride_sk=ssm_states.stride(2),
    )


def _check_cu_seqlens(cu_seqlens: torch.Tensor, state_indices: torch.Tensor) -> None:
    if cu_seqlens.shape != (state_indices.shape[0] + 1,):
        raise ValueError(
            f"cu_seqlens must be [{state_indices.shape[0] + 1}], got {tuple(cu_seqlens.shape)}"
        )


def _output(v: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device) if out is None else out
    if out.shape != v.shape or out.stride(-1) != 1:
        raise ValueError(
            f"out must be shaped like v {tuple(v.shape)} with a contiguous last dim, "
            f"got {tuple(out.shape)}"
        )
    return out


def chunk_gated_delta_rule_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    dims = _check_gdn_inputs(q, k, v, g, beta, ssm_states, state_indices)
    _check_cu_seqlens(cu_seqlens, state_indices)
    # an upper bound: see below
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    out = _output(v, out)
    # Value columns split across programs: each keeps a [dk, 64] state slice, so a 128 x 128 head fits the
    # registers and shared memory of one program; the keys' part (K K^T and its inverse) is redone per slice.
    # The chunk tile shrinks as the key dim grows (tile x dk at most 2048), since registers and shared memory grow
    # with it; chunking only regroups the recurrence, so every tile gives the same result.
    block_v = min(_pad(dims.dv), 64)
    chunk_size = max(16, min(chunk_size, 2048 // _pad(dims.dk)))
    grid = (state_indices.shape[0], dims.hv, triton.cdiv(dims.dv, block_v))
    if grid[0]:
        _chunk_kernel[grid](
            q_ptr=q,
            k_ptr=k,
            v_ptr=v,
            g_ptr=g,
            beta_ptr=beta,
            out_ptr=out,
            states_ptr=ssm_states,
            slots_ptr=state_indices,
            cu_ptr=cu_seqlens,
            **_strides(q, k, v, g, beta, out, ssm_states),
            scale=dims.dk**-0.5 if scale is None else scale,
            GROUP=dims.hv // dims.hk,
            DK=dims.dk,
            DV=dims.dv,
            BK=_pad(dims.dk),
            BV=block_v,
            BT=chunk_size,
            LOG2_BT=chunk_size.bit_length() - 1,
            L2NORM=use_qk_l2norm,
            # the tiles are widened to fp32; 16-bit data need no more than tf32
            PRECISION=dot_precision(q.dtype),
            **_CHUNK_LAUNCH.get(dispatch.gpu_arch(), {}),
        )
    return out


# Launch parameters per target (benchmarks/triton_resources.py measures them): on sm_90 the default 4 warps
# and pipelined loads spill up to 2.2 KB a thread; 8 warps without pipelining keep bf16 free of spills.
_CHUNK_LAUNCH = {"cuda": {"num_warps": 8, "num_stages": 1}}


def fused_recurrent_gated_delta_rule_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per request (its row of q, k, v, g, beta) through the recurrence."""
    dims = _check_gdn_inputs(q, k, v, g, beta, ssm_states, state_indices)
    if state_indices.shape[0] != q.shape[0]:
        raise ValueError(
            f"state_indices has {state_indices.shape[0]} entries for {q.shape[0]} decode tokens"
        )
    out = _output(v, out)
    args = (q, k, v, g, beta, ssm_states, state_indices, out)
    return _launch_recurrent(*args, dims, None, scale, use_qk_l2norm)


def recurrent_prefill_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``chunk_gated_delta_rule_triton``'s prefill (same arguments; ``chunk_size`` unused) token by token, with
    the arithmetic of a decode step: batch invariance's prefill. A token's output and the states after it are
    then the same bits however the prompt is split into chunks, wherever a prefix-cache hit resumes it, and
    whether the token is prefilled or decoded; the chunked kernel's chunks start where each call's tokens do."""
    dims = _check_gdn_inputs(q, k, v, g, beta, ssm_states, state_indices)
    _check_cu_seqlens(cu_seqlens, state_indices)
    out = _output(v, out)
    args = (q, k, v, g, beta, ssm_states, state_indices, out)
    return _launch_recurrent(*args, dims, cu_seqlens, scale, use_qk_l2norm)


def _launch_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    out: torch.Tensor,
    dims: _GdnDims,
    cu_seqlens: torch.Tensor | None,
    scale: float | None,
    use_qk_l2norm: bool,
) -> torch.Tensor:
    block_v = min(_pad(dims.dv), 64)  # more programs per head: decode batches are small
    grid = (state_indices.shape[0], dims.hv, triton.cdiv(dims.dv, block_v))
    if grid[0]:
        _recurrent_kernel[grid](
            q_ptr=q,
            k_ptr=k,
            v_ptr=v,
            g_ptr=g,
            beta_ptr=beta,
            out_ptr=out,
            states_ptr=ssm_states,
            slots_ptr=state_indices,
            cu_ptr=state_indices if cu_seqlens is None else cu_seqlens,
            **_strides(q, k, v, g, beta, out, ssm_states),
            scale=dims.dk**-0.5 if scale is None else scale,
            GROUP=dims.hv // dims.hk,
            DK=dims.dk,
            DV=dims.dv,
            BK=_pad(dims.dk),
            BV=block_v,
            L2NORM=use_qk_l2norm,
            VARLEN=cu_seqlens is not None,
        )
    return out
