"""Loads the Hugging Face tokenizer of a checkpoint (the built-in tiny model when no path is given)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny_qwen3_5_moe"


def load_tokenizer(path: str | None) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path or TINY_MODEL_DIR))
