"""Plain-PyTorch causal depthwise conv1d over packed variable-length batches with a slot-indexed state pool.

Layouts: ``x`` [T, D] packed tokens; ``weight`` [D, K]; ``conv_states`` [S, D, K-1] (the last K-1 inputs of each
request, oldest first, zeros for a new request); ``state_indices`` [B] slot of each request.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..slots import slot_run


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Prefill: each request continues from its pooled state; its last K-1 inputs are written back to the pool."""
    w = weight.float().unsqueeze(1)
    bounds = cu_seqlens.tolist()
    lengths = {e - s for s, e in zip(bounds, bounds[1:])}
    if len(lengths) == 1:
        return _conv_equal_lengths(x, w, conv_states, state_indices, lengths.pop(), activation)
    out = torch.empty_like(x)
    for i, slot in enumerate(state_indices.tolist()):
        start, end = bounds[i], bounds[i + 1]
        # [D, K-1+L]
        window = torch.cat([conv_states[slot].float(), x[start:end].t().float()], dim=1)
        y = F.conv1d(window.unsqueeze(0), w, groups=window.shape[0])[0]  # [D, L]
        out[start:end] = _activate(y, activation).t().to(x.dtype)
        conv_states[slot] = window[:, window.shape[1] - conv_states.shape[2] :].to(
            conv_states.dtype
        )
    return out


def _conv_equal_lengths(
    x: torch.Tensor,
    w: torch.Tensor,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    length: int,
    activation: str | None,
) -> torch.Tensor:
    """Prefill of requests that all run ``length`` tokens: one conv1d over the batch of windows."""
    x_t = x.view(-1, length, x.shape[1]).transpose(1, 2).float()  # [B, D, L]
    # [B, D, K-1+L]
    window = torch.cat([conv_states.index_select(0, state_indices).float(), x_t], dim=2)
    taps = w.squeeze(1).unsqueeze(-1)  # [D, K, 1]
    # a depthwise conv of a few taps: shifted multiply-adds beat conv1d here
    y = window[..., :length] * taps[:, 0]
    for j in range(1, taps.shape[1]):
        y.addcmul_(window[..., j : j + length], taps[:, j])
    conv_states[state_indices] = window[..., window.shape[2] - conv_states.shape[2] :].to(
        conv_states.dtype
    )
    return _activate(y, activation).transpose(1, 2).reshape(x.shape).to(x.dtype)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Decode: one token per request ([B, D]); each request's pooled state is shifted by one in place."""
    run = slot_run(state_indices, conv_states)
    states = (
        conv_states[run] if run is not None else conv_states.index_select(0, state_indices).float()
    )
    window = torch.cat([states, x.float().unsqueeze(-1)], dim=-1)  # [B, D, K]
    y = (window * weight.float()).sum(-1)
    if run is not None:
        states.copy_(window[..., 1:])
    else:  # index_copy_ from a strided source is several times slower than a copy first
        conv_states.index_copy_(
            0, state_indices, window[..., 1:].to(conv_states.dtype).contiguous()
        )
    return _activate(y, activation).to(x.dtype)


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported activation {activation!r}")
