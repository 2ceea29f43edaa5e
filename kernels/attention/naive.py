"""Plain-PyTorch paged attention; also the CPU path.

The pool holds one row per token slot: k_cache, v_cache [N, KV, hd] (rows may be strided: views of a pool that
keeps every layer's K and V of a slot together). Slots come in pages of ``page_size``: ``page_table`` [R,
max_pages] maps (request row, position // page_size) to a page, and position p of a request lives in slot
``page * page_size + p % page_size`` (with page_size 1 the table maps positions to slots). New tokens are written
with ``store_kv`` before attention, so both ``extend_attention`` and ``decode_attention`` read every key and value
(prefix and new) from the pool. ``varlen_attention`` is the pool-free kind: packed segments (the vision tower's
frames) each attending to themselves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    k_cache[loc] = k.to(k_cache.dtype)
    v_cache[loc] = v.to(v_cache.dtype)


def token_slots(
    page_table: torch.Tensor, rows: torch.Tensor, length: int, page_size: int
) -> torch.Tensor:
    """[..., length] slots of positions 0..length-1 of request ``rows`` (a row index or a [B] tensor of them)."""
    if page_size == 1:
        return page_table[rows, :length].long()
    pages = page_table[rows, : -(-length // page_size)].long()
    offsets = torch.arange(page_size, device=pages.device)
    return (pages.unsqueeze(-1) * page_size + offsets).flatten(-2)[..., :length]


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[..., S] slots -> [..., KV, S, hd]; KV heads are not repeated: SDPA's enable_gqa shares them.

    index_select copies whole rows, several times faster on the CPU than advanced indexing."""
    rows = cache.index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *cache.shape[1:]).transpose(-3, -2)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    scale: float,
    page_size: int = 1,
) -> torch.Tensor:
    """New tokens ([T, H, hd], packed by request) attend causally to their request's prefix and to themselves."""
    prefixes, extends = prefix_lens.tolist(), extend_lens.tolist()
    if len(set(zip(prefixes, extends))) == 1:
        length = prefixes[0] + extends[0]
        slots = token_slots(page_table, req_pool_indices.long(), length, page_size)
        return _extend_uniform(q, k_cache, v_cache, slots, prefixes[0], extends[0], scale)
    out = torch.empty_like(q)
    start = 0
    for row, prefix, extend in zip(req_pool_indices.tolist(), prefixes, extends):
        slots = token_slots(page_table, row, prefix + extend, page_size)
        keys, values = _gather(k_cache, slots), _gather(v_cache, slots)
        query = q[start : start + extend].transpose(0, 1)  # [H, E, hd]
        mask = torch.ones(extend, prefix + extend, dtype=torch.bool, device=q.device).tril(prefix)
        o = F.scaled_dot_product_attention(
            query,
            keys.to(q.dtype),
            values.to(q.dtype),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[start : start + extend] = o.transpose(0, 1)
        start += extend
    return out


def _extend_uniform(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    prefix: int,
    extend: int,
    scale: float,
) -> torch.Tensor:
    """Every request has the same prefix and extend lengths (a batch of equal prompts): one batched SDPA call over
    their ``slots`` [B, prefix + extend]."""
    keys, values = _gather(k_cache, slots), _gather(v_cache, slots)  # [B, KV, S, hd]
    query = q.view(slots.shape[0], extend, *q.shape[1:]).transpose(1, 2)  # [B, H, E, hd]
    mask = torch.ones(extend, prefix + extend, dtype=torch.bool, device=q.device).tril(prefix)
    o = F.scaled_dot_product_attention(
        query, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return o.transpose(1, 2).reshape(q.shape)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    page_size: int = 1,
) -> torch.Tensor:
    """One query per request ([B, H, hd]) over its first ``seq_lens`` (>= 1) cached tokens, batched with padding
    to ``max_seq_len`` (read from ``seq_lens`` when not given)."""
    if max_seq_len is not None:
        max_len = max_seq_len
    else:
        max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    mask = torch.arange(max_len, device=q.device) < seq_lens.unsqueeze(1)  # [B, S]
    # Padding positions re-read the request's first slot, which holds a real key and value: the table points them
    # at arbitrary slots (and the rest of a last page is unwritten) whose memory may be uninitialised, and a masked
    # NaN would still poison the weighted sum (0 * NaN = NaN). Fixing the small index tensor is cheaper than zeroing
    # the gathered keys and values.
    slots = token_slots(page_table, req_pool_indices.long(), max_len, page_size)
    slots = slots.where(mask, slots[:, :1])  # [B, S]
    keys, values = _gather(k_cache, slots), _gather(v_cache, slots)
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        keys.to(q.dtype),
        values.to(q.dtype),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return o.squeeze(2)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Each segment of the packed q, k, v [T, H, hd] (segment s: rows ``cu_seqlens[s]`` ..
    ``cu_seqlens[s + 1]``) attends to itself, not causally: one SDPA call a segment, in the input dtype."""
    lengths = cu_seqlens.diff().tolist()
    out = [
        F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in seg), scale=scale)
        for seg in zip(q.split(lengths), k.split(lengths), v.split(lengths))
    ]
    return torch.cat([o.transpose(0, 1) for o in out])
