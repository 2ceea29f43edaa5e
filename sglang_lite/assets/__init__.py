"""Files shipped with the package.

`TINY_MODEL_DIR` holds the built-in tiny Qwen3.5-MoE model: a Hugging Face style folder with config.json, a
trained 4096-token byte-level BPE tokenizer (ChatML chat template) and generation_config.json, but no weights;
the loader fills the model with seeded dummy weights. The tokenizer files are made by
scripts/make_tiny_tokenizer.py; config.json is kept by hand.
"""
from __future__ import annotations

import os
from pathlib import Path

TINY_MODEL_DIR = Path(__file__).parent / "tiny_qwen3_5_moe"


def model_dir(path: str | os.PathLike | None) -> str:
    """The checkpoint folder ``path`` names; the built-in tiny model's when it names none."""
    return os.fspath(path) if path else str(TINY_MODEL_DIR)
