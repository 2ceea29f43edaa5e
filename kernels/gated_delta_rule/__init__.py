"""Gated delta rule: gating, chunked prefill over packed requests, recurrent decode."""
from .naive import chunk_gated_delta_rule, fused_gdn_gating, fused_recurrent_gated_delta_rule

__all__ = ["fused_gdn_gating", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]
