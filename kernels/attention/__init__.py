"""Paged attention over a token-level KV pool: store, extend (prefill) and decode."""
from .naive import decode_attention, extend_attention, store_kv

__all__ = ["store_kv", "extend_attention", "decode_attention"]
