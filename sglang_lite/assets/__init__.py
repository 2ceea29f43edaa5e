"""Files shipped with the package.

`TINY_MODEL_DIR` holds the built-in tiny Qwen3.5-MoE model: a Hugging Face style folder with config.json, a
4096-token byte-level BPE tokenizer (ChatML chat template), generation_config.json, and weights trained on the
Python standard library's source (model.safetensors in bfloat16, with training.json recording the run). The
tokenizer files are made by scripts/make_tiny_tokenizer.py, the weights by scripts/train_tiny_model.py;
config.json is kept by hand. ``load_format="dummy"`` gives the same shape with seeded random weights.
"""

from __future__ import annotations

import os
from pathlib import Path

TINY_MODEL_DIR = Path(__file__).parent / "tiny_qwen3_5_moe"


def model_dir(path: str | os.PathLike | None) -> str:
    """The checkpoint folder ``path`` names; the built-in tiny model's when it names none."""
    return os.fspath(path) if path else str(TINY_MODEL_DIR)
