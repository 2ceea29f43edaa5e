"""RMSNorm family: Gemma RMSNorm (optionally with residual add), fused q/k Gemma RMSNorm, gated RMSNorm."""
from .naive import fused_qk_gemma_rmsnorm, gated_rmsnorm, gemma_rmsnorm

__all__ = ["gemma_rmsnorm", "fused_qk_gemma_rmsnorm", "gated_rmsnorm"]
