"""Loads the Hugging Face tokenizer of a checkpoint (the built-in tiny model's when no path is given)."""

from __future__ import annotations

import os
from typing import Any

from sglang_lite.assets import model_dir
from sglang_lite.server_args import ServerArgs


def load_tokenizer(path: str | os.PathLike | None) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir(path))


def load_server_tokenizer(args: ServerArgs) -> Any:
    """The tokenizer the arguments name (the model's own by default), or None with ``skip_tokenizer_init``."""
    return None if args.skip_tokenizer_init else load_tokenizer(args.tokenizer_dir)
