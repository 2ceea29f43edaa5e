"""Kernels of sglang_lite (installed as ``sglang_lite.kernels``): Triton kernels with PyTorch references.

Each family lives in its own folder with ``naive.py`` (the reference and CPU path), the Triton kernel and a
launcher; the functions exported here pick one per call (see ``dispatch.py``). This package imports only torch,
triton, einops and ``sglang_lite.envs`` (stdlib only: the environment flags it reads when a kernel is called).

Python started in the repository root also finds this folder as a top-level ``kernels``, the import name of Hugging
Face's kernel-hub distribution (which transformers probes by importing it). Imported under that name, this file
exports nothing: it loads the real ``kernels`` in its place when one is installed, and otherwise looks like an empty
namespace package (no ``__file__``), which transformers reads as "not installed"; nothing here imports triton then.
"""

from __future__ import annotations

if __name__ == "kernels":  # found by folder name from the repository root: not sglang_lite.kernels
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None and _spec.origin is not None:  # the installed distribution takes this name
        _real = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _real
        _spec.loader.exec_module(_real)
    else:
        __file__ = None  # noqa: F811  (a namespace package's shape)
        __path__ = []  # noqa: F811  (no submodules under this name)
else:
    from .attention import decode_attention, extend_attention, store_kv
    from .conv1d import causal_conv1d_fn, causal_conv1d_update
    from .gated_delta_rule import (
        chunk_gated_delta_rule,
        fused_gdn_gating,
        fused_recurrent_gated_delta_rule,
    )
    from .linear import linear
    from .moe import fused_moe, moe_route, topk_softmax
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
        "linear",
        "moe_route",
        "per_token_group_quant_fp8",
        "store_kv",
        "topk_softmax",
        "w8a8_block_fp8_matmul",
    ]
