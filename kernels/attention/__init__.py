"""Paged attention: store, extend (prefill) and decode over a KV pool of token slots in pages of ``page_size``.

``page_table`` [R, max_pages] maps (request row, position // page_size) to a page; position p lives in slot
``page * page_size + p % page_size`` of k_cache, v_cache [N, KV, hd] (with page_size 1 the table maps positions
to slots). ``varlen_attention`` needs no pool: packed segments (the vision tower's frames) each attend to
themselves. Each function runs the Triton kernel, the fused C++ CPU kernel (decode, float32) or the PyTorch
reference per call (see ``kernels/dispatch.py``).
"""

from __future__ import annotations

import torch

from .. import batch_invariant, cpu
from ..dispatch import use_native, use_triton
from . import naive, triton_attention, triton_varlen


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """Write k, v [T, KV, hd] into the pool rows ``loc`` [T]."""
    impl = triton_attention if use_triton(k_cache, backend) else naive
    impl.store_kv(k_cache, v_cache, loc, k, v)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    scale: float,
    *,
    page_size: int = 1,
    backend: str | None = None,
) -> torch.Tensor:
    """New tokens ([T, H, hd], packed by request) attend causally to their request's prefix and to themselves."""
    args = (q, k_cache, v_cache, page_table, req_pool_indices, prefix_lens, extend_lens, scale)
    if batch_invariant.enabled() and (
        use_native(q, k_cache, v_cache, backend=backend) or use_triton(q, backend)
    ):
        return _extend_as_decode(*args, page_size=page_size, backend=backend)
    if use_triton(q, backend):
        return triton_attention.extend_attention(*args, page_size=page_size)
    return naive.extend_attention(*args, page_size)


def _extend_as_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    scale: float,
    *,
    page_size: int,
    backend: str | None,
) -> torch.Tensor:
    """Batch invariant extend (C++ or Triton): each new token as one decode query over its request's first
    prefix + i + 1 tokens, so that its arithmetic is a decode step's whatever the chunk, the batch or the prefix
    cache's hit (the decode kernels split a query's keys by its own length alone)."""
    rows = req_pool_indices.repeat_interleave(extend_lens)
    # each request's first token among the new ones
    starts = torch.cumsum(extend_lens, 0) - extend_lens
    index = torch.arange(q.shape[0], device=q.device)
    firsts = (prefix_lens - starts).repeat_interleave(extend_lens)
    lens = firsts + index + 1
    return decode_attention(
        q, k_cache, v_cache, page_table, rows, lens, scale, page_size=page_size, backend=backend
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    page_size: int = 1,
    max_seq_len: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """One query per request ([B, H, hd]) over its first ``seq_lens`` cached tokens.

    ``max_seq_len``, when the caller knows it on the host, spares the PyTorch path reading ``seq_lens.max()`` back
    (a sync, and a graph break under torch.compile); the Triton kernel does not need it."""
    args = (q, k_cache, v_cache, page_table, req_pool_indices, seq_lens, scale)
    if use_native(q, k_cache, v_cache, backend=backend):
        return cpu.decode_attention(*args, page_size)
    if use_triton(q, backend):
        return triton_attention.decode_attention(*args, page_size=page_size)
    return naive.decode_attention(*args, max_seq_len, page_size)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Each segment of the packed q, k, v [T, H, hd] (segment s: rows ``cu_seqlens[s]`` ..
    ``cu_seqlens[s + 1]``, cu_seqlens [S + 1]) attends to itself, not causally."""
    impl = triton_varlen if use_triton(q, backend) else naive
    return impl.varlen_attention(q, k, v, cu_seqlens, scale)


__all__ = ["store_kv", "extend_attention", "decode_attention", "varlen_attention"]
