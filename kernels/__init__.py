"""Kernels of sglang_lite (installed as ``sglang_lite.kernels``): Triton kernels with PyTorch references.

Each family lives in its own folder with ``naive.py`` (the reference and CPU path), the Triton kernel and a
launcher; the functions exported here pick one per call (see ``dispatch.py``). This package imports only torch,
triton, einops and ``sglang_lite.envs`` (stdlib only: the environment flags it reads when a kernel is called).
"""
from .attention import decode_attention, extend_attention, store_kv
from .conv1d import causal_conv1d_fn, causal_conv1d_update
from .gated_delta_rule import chunk_gated_delta_rule, fused_gdn_gating, fused_recurrent_gated_delta_rule
from .moe import fused_moe, topk_softmax
from .norms import fused_qk_gemma_rmsnorm, gated_rmsnorm, gemma_rmsnorm
from .quant import fp8_dtype, per_token_group_quant_fp8, w8a8_block_fp8_matmul
from .rotary import apply_rotary

__all__ = [
    "apply_rotary",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "decode_attention",
    "extend_attention",
    "fused_gdn_gating",
    "fused_moe",
    "fused_qk_gemma_rmsnorm",
    "fp8_dtype",
    "fused_recurrent_gated_delta_rule",
    "gated_rmsnorm",
    "gemma_rmsnorm",
    "per_token_group_quant_fp8",
    "store_kv",
    "topk_softmax",
    "w8a8_block_fp8_matmul",
]
