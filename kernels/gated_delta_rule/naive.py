"""Plain-PyTorch gated delta rule (Gated DeltaNet); also the CPU path.

Layouts: q, k [T, HK, dk]; v [T, HV, dv]; g, beta [T, HV] (fp32); packed requests delimited by ``cu_seqlens``.
Recurrent state per request: [HV, dk, dv] in fp32, held in ``ssm_states`` [S, HV, dk, dv] at ``state_indices``.
Value head h reads key head h // (HV // HK). Per step:
``S = exp(g) S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T (scale q)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_gdn_gating(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``, both fp32, shaped like ``a``."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, scale: float, use_qk_l2norm: bool):
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    groups = num_v_heads // k.shape[-2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=-2), k.repeat_interleave(groups, dim=-2)
    return q * scale, k


def _check_heads(k: torch.Tensor, v: torch.Tensor) -> None:
    if v.shape[-2] % k.shape[-2]:
        raise ValueError(f"value heads ({v.shape[-2]}) must be a multiple of key heads ({k.shape[-2]})")


def _chunk_one_sequence(q, k, v, g, beta, state, chunk_size):
    """One request, token-major: q, k [L, H, dk], v [L, H, dv], g, beta [L, H], state [H, dk, dv] (fp32).

    Tensors are laid out chunk-major ([n, H, C, ...]) so every per-chunk slice in the sequential loop is
    contiguous. Within a chunk the delta updates fold into one triangular solve (the UT transform); across chunks
    only the state recursion is sequential (two small matmuls per chunk), and the outputs are computed afterwards
    from the saved chunk-start states in two batched matmuls. Padded positions have k = 0 and g = 0, so they
    leave the state untouched.
    """
    length, heads, dv = v.shape
    n = -(-length // chunk_size)
    q, k, v, g, beta = (_to_chunks(t, n, chunk_size) for t in (q, k, v, g, beta))
    g_cum = g.cumsum(-1)
    g_exp = g_cum.exp()
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (g_cum.unsqueeze(-1) - g_cum.unsqueeze(-2)).masked_fill_(~lower, float("-inf")).exp_()
    k_beta = k * beta.unsqueeze(-1)
    k_t = k.transpose(-1, -2)
    # (I + strictly_lower(k_beta k^T * decay)) is the UT system; both right-hand sides go through one solve.
    ut = (k_beta @ k_t).mul_(decay)
    rhs = torch.empty(n, heads, chunk_size, dv + k.shape[-1], dtype=k.dtype, device=k.device)
    torch.mul(v, beta.unsqueeze(-1), out=rhs[..., :dv])
    torch.mul(k_beta, g_exp.unsqueeze(-1), out=rhs[..., dv:])
    uw = _unit_lower_inverse(ut) @ rhs
    u, w = uw[..., :dv], uw[..., dv:]
    k_to_end_t = (k * (g_cum[..., -1:] - g_cum).exp_().unsqueeze(-1)).transpose(-1, -2)
    chunk_decay = g_exp[..., -1, None, None]
    states = torch.empty((n + 1,) + tuple(state.shape), dtype=state.dtype, device=state.device)
    states[0] = state
    v_new = torch.empty_like(u, memory_format=torch.contiguous_format)
    for i in range(n):  # contiguous out= slices: a strided out= makes baddbmm fall back to one call per head
        torch.baddbmm(u[i], w[i], states[i], alpha=-1, out=v_new[i])
        torch.baddbmm(states[i] * chunk_decay[i], k_to_end_t[i], v_new[i], out=states[i + 1])
    out = (q * g_exp.unsqueeze(-1)) @ states[:n] + (q @ k_t).mul_(decay) @ v_new
    state = states[n]
    return out.transpose(1, 2).reshape(n * chunk_size, heads, dv)[:length], state


def _unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """Inverse of unit lower-triangular matrices (the strict upper part and diagonal of ``a`` are ignored).

    2x2 blocks, [[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]], recursing down to 16x16 solves: on the
    CPU batched matmuls beat one LAPACK solve per small matrix.
    """
    size = a.shape[-1]
    if size <= 16 or size % 2:
        eye = torch.eye(size, dtype=a.dtype, device=a.device).expand_as(a)
        return torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True)
    h = size // 2
    top, bottom = _unit_lower_inverse(a[..., :h, :h]), _unit_lower_inverse(a[..., h:, h:])
    out = torch.zeros_like(a)
    out[..., :h, :h] = top
    out[..., h:, h:] = bottom
    out[..., h:, :h] = -(bottom @ a[..., h:, :h] @ top)
    return out


def _to_chunks(t: torch.Tensor, n: int, chunk_size: int) -> torch.Tensor:
    """[L, H, ...] token-major -> [n, H, C, ...] chunk-major and contiguous, zero-padded to whole chunks."""
    length = t.shape[0]
    if length != n * chunk_size:
        t = torch.cat([t, t.new_zeros((n * chunk_size - length,) + tuple(t.shape[1:]))])
    return t.reshape((n, chunk_size) + tuple(t.shape[1:])).transpose(1, 2).contiguous()


def chunk_gated_delta_rule(
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
) -> torch.Tensor:
    """Prefill over packed requests; each starts from its pooled state and its final state is written back."""
    _check_heads(k, v)
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    qf, kf = _prepare_qk(q, k, v.shape[-2], scale, use_qk_l2norm)
    bounds = cu_seqlens.tolist()
    lengths = [e - s for s, e in zip(bounds, bounds[1:])]
    pieces = (qf, kf, v.float(), g.float(), beta.float())
    if lengths and len(lengths) * max(lengths) <= 2 * bounds[-1]:
        return _chunk_padded(pieces, ssm_states, state_indices, lengths, chunk_size).to(v.dtype)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for i, slot in enumerate(state_indices.tolist()):
        s, e = bounds[i], bounds[i + 1]
        o, state = _chunk_one_sequence(*(t[s:e] for t in pieces), ssm_states[slot].float(), chunk_size)
        out[s:e] = o.to(v.dtype)
        ssm_states[slot] = state.to(ssm_states.dtype)
    return out


def _chunk_padded(pieces, ssm_states, state_indices, lengths, chunk_size) -> torch.Tensor:
    """All requests in one pass: each is zero-padded to the longest (padding leaves states untouched) and the heads
    of all requests sit side by side, so the per-chunk loop runs once instead of once per request."""
    num_seqs, max_len, heads = len(lengths), max(lengths), pieces[2].shape[1]
    rows = _padded_rows(lengths, max_len, pieces[0].device)
    padded = [_to_head_major(_pad(t, rows, num_seqs * max_len), num_seqs) for t in pieces]
    slots = state_indices.long()
    state = ssm_states.index_select(0, slots).float().flatten(0, 1)  # [B * HV, dk, dv]
    o, state = _chunk_one_sequence(*padded, state, chunk_size)
    ssm_states[slots] = state.view(num_seqs, heads, *state.shape[1:]).to(ssm_states.dtype)
    o = o.view(max_len, num_seqs, heads, -1).transpose(0, 1).reshape(num_seqs * max_len, heads, -1)
    return o if rows is None else o[rows]


def _padded_rows(lengths: list[int], max_len: int, device: torch.device) -> torch.Tensor | None:
    """Row of each packed token in the [B * max_len] padded layout; None when no request needs padding."""
    if all(n == max_len for n in lengths):
        return None
    lens = torch.tensor(lengths, device=device)
    starts = torch.arange(len(lengths), device=device) * max_len - (lens.cumsum(0) - lens)
    return torch.arange(int(lens.sum()), device=device) + starts.repeat_interleave(lens)


def _pad(t: torch.Tensor, rows: torch.Tensor | None, num_rows: int) -> torch.Tensor:
    if rows is None:
        return t
    out = t.new_zeros((num_rows,) + tuple(t.shape[1:]))
    out[rows] = t
    return out


def _to_head_major(t: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[B * L, H, ...] -> [L, B * H, ...]: the requests' heads become heads of one long sequence."""
    t = t.view(num_seqs, -1, *t.shape[1:]).transpose(0, 1)
    return t.reshape(t.shape[0], num_seqs * t.shape[2], *t.shape[3:])


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Decode: one token per request (q, k [B, HK, dk]; v [B, HV, dv]); pooled states updated in place."""
    _check_heads(k, v)
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    qf, kf = _prepare_qk(q, k, v.shape[-2], scale, use_qk_l2norm)
    state = ssm_states.index_select(0, state_indices).float()  # [B, HV, dk, dv], a gathered copy
    state.mul_(g.float().exp()[..., None, None])
    predicted = (kf.unsqueeze(-2) @ state).squeeze(-2)  # S^T k
    delta = beta.float().unsqueeze(-1) * (v.float() - predicted)
    state.add_(kf.unsqueeze(-1) * delta.unsqueeze(-2))
    ssm_states[state_indices] = state.to(ssm_states.dtype)
    return (qf.unsqueeze(-2) @ state).squeeze(-2).to(v.dtype)
