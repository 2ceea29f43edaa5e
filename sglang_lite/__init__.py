"""sglang_lite: compact serving for the Qwen3.5 model family.

Heavy parts (torch, models, engine) are imported on first use, so that light entry points such as
``python -m sglang_lite.router`` start without importing torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "load_model": "sglang_lite.models.loader",
    "ModelConfig": "sglang_lite.config",
    "Qwen3_5ForCausalLM": "sglang_lite.models.qwen3_5",
    "Qwen3_5MoeForCausalLM": "sglang_lite.models.qwen3_5",
    "Engine": "sglang_lite.engine",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'sglang_lite' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


__all__ = list(_LAZY)
