"""Fused mixture of experts: softmax top-k routing and the grouped expert computation."""
from .naive import fused_moe, topk_softmax

__all__ = ["topk_softmax", "fused_moe"]
