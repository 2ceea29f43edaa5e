"""Triton causal depthwise conv1d (+ SiLU) over packed requests, with the conv state kept in a slot pool.

Layouts as in ``naive.py``: x [T, D] (or [B, D] for decode), weight [D, K], conv_states [S, D, K-1].
Prefill: one program per (request, channel block, tile of BLOCK_T tokens), so a long request spreads over the GPU
(one program walking all of a request's tiles gave 64 programs at B=1, D=8192, for an H200's 132 SMs, and lost to
F.conv1d there). The tile that starts a request reads the pooled initial state; a second launch writes the
final state, after every read of the old one.

Both kernels add a token's K products in tap order into one fp32 sum, each input read from the request's tokens or
the pooled ones before them: a token's output is the same bits however its prompt is split into chunks, wherever
a prefix-cache hit resumes it, and whether it is prefilled or decoded (batch invariance needs no switch here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _load_input(
    x_ptr, state_ptr, pos, chans, length, stride_x, stride_sd, K: tl.constexpr, D: tl.constexpr
):
    """Inputs at request positions ``pos`` (negative positions come from the K-1 pooled inputs) -> [P, BLOCK_D]."""
    chan_ok = (chans < D)[None, :]
    from_x = tl.load(
        x_ptr + pos[:, None] * stride_x + chans[None, :],
        mask=((pos >= 0) & (pos < length))[:, None] & chan_ok,
        other=0.0,
    )
    from_state = tl.load(
        state_ptr + chans[None, :] * stride_sd + (pos + K - 1)[:, None],
        mask=((pos < 0) & (pos + K - 1 >= 0))[:, None] & chan_ok,
        other=0.0,
    )
    return tl.where((pos >= 0)[:, None], from_x.to(tl.float32), from_state.to(tl.float32))


@triton.jit
def _taps(
    x_req,
    w_ptr,
    state_ptr,
    pos,
    chans,
    length,
    stride_x,
    stride_w,
    stride_sd,
    K: tl.constexpr,
    D: tl.constexpr,
    FROM_STATE: tl.constexpr,
):
    """The sum over taps 0..K-1, in that order, of input(pos + tap - (K-1)) * w[tap] in fp32 -> [P, BLOCK_D].
    ``FROM_STATE`` (a request's first tile): inputs before the request come from the pooled state; later tiles
    reach back to none."""
    chan_ok = (chans < D)[None, :]
    acc = tl.zeros((pos.shape[0], chans.shape[0]), dtype=tl.float32)
    for tap in tl.static_range(K):
        src = pos + tap - (K - 1)
        w = tl.load(w_ptr + chans * stride_w + tap, mask=chans < D, other=0.0).to(tl.float32)
        if FROM_STATE:
            value = _load_input(x_req, state_ptr, src, chans, length, stride_x, stride_sd, K, D)
        else:
            src_ok = ((src >= 0) & (src < length))[:, None] & chan_ok
            value = tl.load(
                x_req + src[:, None] * stride_x + chans[None, :], mask=src_ok, other=0.0
            )
        acc += value.to(tl.float32) * w[None, :]
    return acc


@triton.jit
def _causal_conv1d_fwd_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    states_ptr,
    slots_ptr,
    cu_ptr,
    stride_x,
    stride_out,
    stride_w,
    stride_ss,
    stride_sd,
    D: tl.constexpr,
    K: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    req = tl.program_id(0)
    dblock = tl.program_id(1)
    tile = tl.program_id(2)
    start = tl.load(cu_ptr + req)
    length = tl.load(cu_ptr + req + 1) - start
    if tile * BLOCK_T >= length:
        return
    state_ptr = states_ptr + tl.load(slots_ptr + req).to(tl.int64) * stride_ss
    x_req = x_ptr + start.to(tl.int64) * stride_x
    chans = dblock * BLOCK_D + tl.arange(0, BLOCK_D)
    pos = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    strides = stride_x, stride_w, stride_sd
    if tile == 0:  # the first K-1 outputs also see the pooled inputs before the request
        acc = _taps(x_req, w_ptr, state_ptr, pos, chans, length, *strides, K, D, True)
    else:
        acc = _taps(x_req, w_ptr, state_ptr, pos, chans, length, *strides, K, D, False)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    out_mask = (pos < length)[:, None] & (chans < D)[None, :]
    tl.store(
        out_ptr + (start + pos).to(tl.int64)[:, None] * stride_out + chans[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=out_mask,
    )


@triton.jit
def _conv_state_after_prefill_kernel(
    x_ptr,
    states_ptr,
    slots_ptr,
    cu_ptr,
    stride_x,
    stride_ss,
    stride_sd,
    D: tl.constexpr,
    K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The new state is the request's last K-1 inputs (some from the old state when the request is shorter)."""
    req, dblock = tl.program_id(0), tl.program_id(1)
    start = tl.load(cu_ptr + req)
    length = tl.load(cu_ptr + req + 1) - start
    state_ptr = states_ptr + tl.load(slots_ptr + req).to(tl.int64) * stride_ss
    chans = dblock * BLOCK_D + tl.arange(0, BLOCK_D)
    tail = length - (K - 1) + tl.arange(0, BLOCK_K)
    x_req = x_ptr + start.to(tl.int64) * stride_x
    # [BLOCK_K, BLOCK_D]
    new_state = _load_input(x_req, state_ptr, tail, chans, length, stride_x, stride_sd, K, D)
    tl.debug_barrier()  # all of the old state is read before any of it is overwritten
    dst = state_ptr + chans[None, :] * stride_sd + tl.arange(0, BLOCK_K)[:, None]
    keep = (tl.arange(0, BLOCK_K) < K - 1)[:, None] & (chans < D)[None, :]
    tl.store(dst, new_state.to(states_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _causal_conv1d_update_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    states_ptr,
    slots_ptr,
    stride_x,
    stride_out,
    stride_w,
    stride_ss,
    stride_sd,
    D: tl.constexpr,
    K: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    req, dblock = tl.program_id(0), tl.program_id(1)
    state_ptr = states_ptr + tl.load(slots_ptr + req).to(tl.int64) * stride_ss
    chans = dblock * BLOCK_D + tl.arange(0, BLOCK_D)
    chan_ok = (chans < D)[:, None]
    x = tl.load(x_ptr + req.to(tl.int64) * stride_x + chans, mask=chans < D, other=0.0)
    # the window of K inputs (K-1 pooled ones, then this token) tap by tap, in the prefill kernel's order
    y = tl.zeros([BLOCK_D], dtype=tl.float32)
    for tap in tl.static_range(K):
        if tap < K - 1:
            value = tl.load(state_ptr + chans * stride_sd + tap, mask=chans < D, other=0.0)
        else:
            value = x
        w = tl.load(w_ptr + chans * stride_w + tap, mask=chans < D, other=0.0).to(tl.float32)
        y += value.to(tl.float32) * w
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(
        out_ptr + req.to(tl.int64) * stride_out + chans,
        y.to(out_ptr.dtype.element_ty),
        mask=chans < D,
    )
    # Shift by one: slot j takes window[j + 1]; the barrier orders all reads of the old state before the writes.
    taps = tl.arange(0, BLOCK_K)
    shifted = tl.load(
        state_ptr + chans[:, None] * stride_sd + taps[None, :] + 1,
        mask=chan_ok & (taps < K - 2)[None, :],
        other=0.0,
    ).to(tl.float32)
    shifted = tl.where((taps == K - 2)[None, :], x.to(tl.float32)[:, None], shifted)
    tl.debug_barrier()
    tl.store(
        state_ptr + chans[:, None] * stride_sd + taps[None, :],
        shifted.to(states_ptr.dtype.element_ty),
        mask=chan_ok & (taps < K - 1)[None, :],
    )


# ---------------------------------------------------------------------------------------------------- launchers


def _silu_flag(activation: str | None) -> bool:
    if activation is None:
        return False
    if activation in ("silu", "swish"):
        return True
    raise ValueError(f"unsupported activation {activation!r}")


def _check_common(
    x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, state_indices: torch.Tensor
) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(
            f"x must be [tokens, D] with a contiguous last dim, got {tuple(x.shape)} strides {x.stride()}"
        )
    d = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != d or weight.stride(1) != 1:
        raise ValueError(
            f"weight must be [D={d}, K] with a contiguous last dim, got {tuple(weight.shape)}"
        )
    k = weight.shape[1]
    if conv_states.dim() != 3 or conv_states.shape[1:] != (d, k - 1) or conv_states.stride(2) != 1:
        raise ValueError(
            f"conv_states must be [slots, {d}, {k - 1}] with a contiguous last dim, "
            f"got {tuple(conv_states.shape)}"
        )
    if state_indices.dim() != 1 or state_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"state_indices must be a 1-D integer tensor, "
            f"got {tuple(state_indices.shape)} {state_indices.dtype}"
        )


def _block_d(d: int) -> int:
    return min(triton.next_power_of_2(d), 128)


def causal_conv1d_fn_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    activation: str | None = "silu",
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    _check_common(x, weight, conv_states, state_indices)
    if cu_seqlens.shape != (state_indices.shape[0] + 1,):
        raise ValueError(
            f"cu_seqlens must be [{state_indices.shape[0] + 1}], got {tuple(cu_seqlens.shape)}"
        )
    out = torch.empty_like(x) if out is None else out
    if out.shape != x.shape or out.stride(1) != 1:
        raise ValueError(f"out must be shaped like x {tuple(x.shape)} with a contiguous last dim")
    d, k = weight.shape
    # 16 x 128 fits sm_90's registers without spills (64 x 128 spilled; benchmarks/triton_resources.py)
    block_t, block_d = 16, _block_d(d)
    # as many token tiles as the whole batch has: no host read of the longest request; the surplus exits at once
    grid = (state_indices.shape[0], triton.cdiv(d, block_d), triton.cdiv(x.shape[0], block_t))
    if grid[0] and grid[2]:
        _causal_conv1d_fwd_kernel[grid](
            x_ptr=x,
            w_ptr=weight,
            out_ptr=out,
            states_ptr=conv_states,
            slots_ptr=state_indices,
            cu_ptr=cu_seqlens,
            stride_x=x.stride(0),
            stride_out=out.stride(0),
            stride_w=weight.stride(0),
            stride_ss=conv_states.stride(0),
            stride_sd=conv_states.stride(1),
            D=d,
            K=k,
            SILU=_silu_flag(activation),
            BLOCK_T=block_t,
            BLOCK_D=block_d,
        )
    if grid[0]:
        _conv_state_after_prefill_kernel[grid[:2]](
            x_ptr=x,
            states_ptr=conv_states,
            slots_ptr=state_indices,
            cu_ptr=cu_seqlens,
            stride_x=x.stride(0),
            stride_ss=conv_states.stride(0),
            stride_sd=conv_states.stride(1),
            D=d,
            K=k,
            BLOCK_D=block_d,
            BLOCK_K=triton.next_power_of_2(max(k - 1, 1)),
        )
    return out


def causal_conv1d_update_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    _check_common(x, weight, conv_states, state_indices)
    if state_indices.shape[0] != x.shape[0]:
        raise ValueError(
            f"state_indices has {state_indices.shape[0]} entries for {x.shape[0]} decode tokens"
        )
    out = torch.empty_like(x) if out is None else out
    if out.shape != x.shape or out.stride(1) != 1:
        raise ValueError(f"out must be shaped like x {tuple(x.shape)} with a contiguous last dim")
    d, k = weight.shape
    grid = (x.shape[0], triton.cdiv(d, _block_d(d)))
    if grid[0]:
        _causal_conv1d_update_kernel[grid](
            x_ptr=x,
            w_ptr=weight,
            out_ptr=out,
            states_ptr=conv_states,
            slots_ptr=state_indices,
            stride_x=x.stride(0),
            stride_out=out.stride(0),
            stride_w=weight.stride(0),
            stride_ss=conv_states.stride(0),
            stride_sd=conv_states.stride(1),
            D=d,
            K=k,
            SILU=_silu_flag(activation),
            BLOCK_D=_block_d(d),
            BLOCK_K=triton.next_power_of_2(k),
        )
    return out
