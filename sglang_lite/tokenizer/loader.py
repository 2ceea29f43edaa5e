"""Loads the Hugging Face tokenizer of a checkpoint (the built-in tiny model's when no path is given)."""
from __future__ import annotations

import os
from typing import Any

from sglang_lite.assets import model_dir


def load_tokenizer(path: str | os.PathLike | None) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir(path))
