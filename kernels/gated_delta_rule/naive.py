"""Plain-PyTorch gated delta rule (Gated DeltaNet); also the CPU path.

Layouts: q, k [T, HK, dk]; v [T, HV, dv]; g, beta [T, HV] (fp32); packed requests delimited by ``cu_seqlens``.
Recurrent state per request: [HV, dk, dv] in fp32, held in ``ssm_states`` [S, HV, dk, dv] at ``state_indices``.
Value head h reads key head h // (HV // HK). Per step:
``S = exp(g) S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T (scale q)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange

from ..slots import slot_run


def fused_gdn_gating(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``, both fp32, shaped like ``a``."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


def l2norm(x: torch.Tensor, scale: float = 1.0, eps: float = 1e-6) -> torch.Tensor:
    """``scale * x / sqrt(sum(x^2) + eps)`` over the last dimension."""
    return x * _l2norm_factor(x, scale, eps)


def _l2norm_factor(x: torch.Tensor, scale: float, eps: float) -> torch.Tensor:
    return torch.linalg.vecdot(x, x).add_(eps).rsqrt_().mul_(scale).unsqueeze(-1)


def _prepare_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, scale: float, use_qk_l2norm: bool
):
    q, k = q.float(), k.float()
    q, k = (l2norm(q, scale), l2norm(k)) if use_qk_l2norm else (q * scale, k)
    return _repeat_key_heads(q, k, num_v_heads)


def _repeat_key_heads(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA: value head h reads key head h // (HV // HK)."""
    groups = num_v_heads // k.shape[-2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=-2), k.repeat_interleave(groups, dim=-2)
    return q, k


def _check_heads(k: torch.Tensor, v: torch.Tensor) -> None:
    if v.shape[-2] % k.shape[-2]:
        raise ValueError(
            f"value heads ({v.shape[-2]}) must be a multiple of key heads ({k.shape[-2]})"
        )


def _chunk_one_sequence(q, k, v, g, beta, state, chunk_size, scale, use_qk_l2norm):
    """One request, token-major: q, k [L, H, dk], v [L, H, dv], g, beta [L, H], state [H, dk, dv] (fp32).

    Tensors are laid out chunk-major ([n, H, C, ...]) so every per-chunk slice in the sequential loop is
    contiguous. Within a chunk the delta updates fold into one triangular solve (the UT transform); across chunks
    only the state recursion is sequential (three small matmuls per chunk: the output's read of the chunk-start
    state, v_new = u - w S, and the state update), and the intra-chunk outputs are added afterwards in one batched
    matmul. Padded positions have k = 0 and g = 0, so they leave the state untouched. The chunk-major copies are
    private, so they are scaled in place; q and k are L2-normalised (when asked) as they are copied.
    """
    length = v.shape[0]
    heads, dv = v.shape[1:]
    n = -(-length // chunk_size)
    if use_qk_l2norm:  # normalised while copied into the chunk-major layout
        q_scale, k_scale = _l2norm_factor(q, scale, 1e-6), _l2norm_factor(k, 1.0, 1e-6)
    else:
        q_scale, k_scale = q.new_full((*q.shape[:-1], 1), scale), None
    q, k = _to_chunks(q, n, chunk_size, q_scale), _to_chunks(k, n, chunk_size, k_scale)
    v = _to_chunks(v, n, chunk_size)
    g = _to_chunks(g, n, chunk_size)
    beta = _to_chunks(beta, n, chunk_size)
    g_cum = g.cumsum_(-1)
    decay = _pairwise_decay(g_cum)
    to_end = _flushed_exp_(g_cum[..., -1:] - g_cum)
    g_exp = _flushed_exp_(g_cum)
    k_t = k.transpose(-1, -2)
    attn = torch.matmul(q, k_t).mul_(decay)
    # (I + strictly_lower((beta k) k^T * decay)) is the UT system T: u = T^-1 (beta v), w = T^-1 (beta exp(g_cum) k).
    # beta and exp(g_cum) scale the columns of T^-1 (in place) rather than the rows of v and k.
    inverse = _unit_lower_inverse(torch.matmul(k, k_t).mul_(decay).mul_(beta.unsqueeze(-1)))
    u = torch.matmul(inverse.mul_(beta.unsqueeze(-2)), v)
    w = torch.matmul(inverse.mul_(g_exp.unsqueeze(-2)), k)
    # keys decayed to the end of their chunk
    k_to_end_t = k.mul_(to_end.unsqueeze(-1)).transpose(-1, -2)
    chunk_decay = g_exp[..., -1, None, None]
    state = state.clone()  # advanced in place
    out = torch.empty_like(v)
    v_new = u  # overwritten chunk by chunk: v_new = u - w S
    # Each chunk reads the state S at its start, then advances it in place: S = exp(g_last) S + k_to_end^T v_new.
    # The slices along dim 0 are contiguous: a strided out= makes bmm fall back to one call per head.
    for q_i, w_i, v_i, k_i, d_i, o_i in zip(q, w, v_new, k_to_end_t, chunk_decay, out):
        torch.matmul(q_i, state, out=o_i)
        v_i.baddbmm_(w_i, state, alpha=-1)
        state.mul_(d_i).baddbmm_(k_i, v_i)
    # o = exp(g_cum) (q S) + (q k^T * decay) v_new: the read of the chunk-start state plus the intra-chunk part
    out.mul_(g_exp.unsqueeze(-1))
    out.view(-1, chunk_size, dv).baddbmm_(
        attn.view(-1, chunk_size, chunk_size), v_new.view(-1, chunk_size, dv)
    )
    return out.transpose(1, 2).reshape(n * chunk_size, heads, dv)[:length], state


# exp(x) below e^-60 (~1e-26) is flushed to 0: far beneath fp32 resolution of any sum it joins. On the CPU, exp is
# far slower when its result underflows into denormals (or its input is -inf), and denormal products slow every
# later matmul, so log-decays are clamped before exp and tiny results zeroed after.
_LOG_FLUSH = -60.0
# just above fp32 exp(_LOG_FLUSH), so clamped entries become 0
_EXP_FLUSH = math.exp(_LOG_FLUSH) * (1 + 1e-5)


def _flushed_exp_(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in place, exactly 0 where x <= -60."""
    return F.threshold_(x.clamp_(min=_LOG_FLUSH).exp_(), _EXP_FLUSH, 0.0)


def _pairwise_decay(g_cum: torch.Tensor) -> torch.Tensor:
    """[..., C] cumulative log-decays -> [..., C, C] with exp(g_cum_i - g_cum_j) for j <= i and 0 above."""
    size = g_cum.shape[-1]
    above = torch.full((size, size), float("-inf"), dtype=g_cum.dtype, device=g_cum.device).triu_(1)
    return _flushed_exp_((g_cum.unsqueeze(-1) - g_cum.unsqueeze(-2)).add_(above))


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


def _to_chunks(
    t: torch.Tensor, n: int, chunk_size: int, row_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """[L, H, ...] token-major -> a new [n, H, C, ...] chunk-major tensor, zero-padded to whole chunks.

    ``row_scale`` ([L, H, 1]) multiplies each row on the way, in the same pass as the copy."""
    out = t.new_empty((n, t.shape[1], chunk_size) + tuple(t.shape[2:]))
    tokens = out.transpose(1, 2)  # [n, C, H, ...] view
    full, rest = divmod(t.shape[0], chunk_size)
    split = full * chunk_size
    _copy_rows(tokens[:full], t[:split], None if row_scale is None else row_scale[:split])
    if rest:
        _copy_rows(tokens[full, :rest], t[split:], None if row_scale is None else row_scale[split:])
        tokens[full, rest:].zero_()
    return out


def _copy_rows(dst: torch.Tensor, src: torch.Tensor, row_scale: torch.Tensor | None) -> None:
    src = src.view(dst.shape)
    if row_scale is None:
        dst.copy_(src)
    else:
        torch.mul(src, row_scale.view(*dst.shape[:-1], 1), out=dst)


# Per-token work inside a chunk grows with its size while the sequential loop gets shorter: on the CPU, 32-token
# chunks beat 64-token ones and 16 gains nothing more (docs/performance.md).
_CPU_CHUNK_SIZE = 32


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
    """Prefill over packed requests; each starts from its pooled state and its final state is written back.

    ``chunk_size`` is the Triton tile; the result does not depend on it (up to rounding) and this path caps it at
    32 tokens.
    """
    _check_heads(k, v)
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    chunk_size = min(chunk_size, _CPU_CHUNK_SIZE)
    # normalised later, on the chunk-major copies
    qf, kf = _repeat_key_heads(q.float(), k.float(), v.shape[-2])
    qk_norm = (scale, use_qk_l2norm)
    bounds = cu_seqlens.tolist()
    lengths = [e - s for s, e in zip(bounds, bounds[1:])]
    pieces = (qf, kf, v.float(), g.float(), beta.float())
    if lengths and len(lengths) * max(lengths) <= 2 * bounds[-1]:
        return _chunk_padded(pieces, ssm_states, state_indices, lengths, chunk_size, qk_norm).to(
            v.dtype
        )
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for i, slot in enumerate(state_indices.tolist()):
        s, e = bounds[i], bounds[i + 1]
        o, state = _chunk_one_sequence(
            *(t[s:e] for t in pieces), ssm_states[slot].float(), chunk_size, *qk_norm
        )
        out[s:e] = o.to(v.dtype)
        ssm_states[slot] = state.to(ssm_states.dtype)
    return out


def _chunk_padded(pieces, ssm_states, state_indices, lengths, chunk_size, qk_norm) -> torch.Tensor:
    """All requests in one pass: each is zero-padded to the longest (padding leaves states untouched) and the heads
    of all requests sit side by side, so the per-chunk loop runs once instead of once per request."""
    num_seqs, max_len = len(lengths), max(lengths)
    heads = pieces[2].shape[1]
    rows = _padded_rows(lengths, max_len, pieces[0].device)
    padded = [_to_head_major(_pad(t, rows, num_seqs * max_len), num_seqs) for t in pieces]
    slots = state_indices.long()
    state = ssm_states.index_select(0, slots).float().flatten(0, 1)  # [B * HV, dk, dv]
    o, state = _chunk_one_sequence(*padded, state, chunk_size, *qk_norm)
    ssm_states[slots] = state.view(num_seqs, heads, *state.shape[1:]).to(ssm_states.dtype)
    o = rearrange(o, "l (b h) d -> (b l) h d", b=num_seqs)
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
    """Decode: one token per request (q, k [B, HK, dk]; v [B, HV, dv]); pooled states updated in place.

    The state is the big operand (dk x dv per head against dk + dv for the token), so it is passed over as few
    times as possible: one read gives S^T k and S^T q together, and one fused multiply-add writes
    S' = exp(g) S + k delta^T. The output needs no second read: S'^T q = exp(g) S^T q + (k . q) delta.
    """
    _check_heads(k, v)
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    qf, kf = _prepare_qk(q, k, v.shape[-2], scale, use_qk_l2norm)
    run = slot_run(state_indices, ssm_states)
    state = (
        ssm_states[run] if run is not None else ssm_states.index_select(0, state_indices).float()
    )
    # [B * HV, dk, dv]: a view of the pool's run, unless its slots are strided (a pool keeping a slot's layers
    # together), where it is a copy written back below
    flat = state.reshape(-1, *state.shape[2:])
    decay = g.float().exp().reshape(-1, 1)
    # [B * HV, 2, dv]
    reads = torch.bmm(torch.stack([kf, qf], dim=-2).view(flat.shape[0], 2, -1), flat)
    delta = (v.float().reshape(-1, v.shape[-1]) - reads[:, 0] * decay).mul_(
        beta.float().reshape(-1, 1)
    )
    out = torch.addcmul(reads[:, 1] * decay, torch.linalg.vecdot(kf, qf).reshape(-1, 1), delta)
    flat.mul_(decay.unsqueeze(-1)).baddbmm_(kf.reshape(-1, kf.shape[-1], 1), delta.unsqueeze(1))
    if run is None:
        ssm_states.index_copy_(0, state_indices, flat.view(state.shape).to(ssm_states.dtype))
    elif flat.data_ptr() != state.data_ptr():
        state.copy_(flat.view(state.shape))
    return out.view(v.shape).to(v.dtype)
