"""Causal depthwise conv1d with SiLU over packed requests (prefill) and one token per request (decode)."""
from .naive import causal_conv1d_fn, causal_conv1d_update

__all__ = ["causal_conv1d_fn", "causal_conv1d_update"]
