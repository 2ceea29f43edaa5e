"""Files shipped with the package.

`TINY_MODEL_DIR` holds the built-in tiny Qwen3.5-MoE model: a Hugging Face style folder with config.json, a
4096-token byte-level BPE tokenizer (ChatML chat template), generation_config.json, and weights trained on the
Python standard library's source (model.safetensors in bfloat16, with training.json recording the run). The
tokenizer files are made by scripts/make_tiny_tokenizer.py, the weights by scripts/train_tiny_model.py;
config.json is kept by hand. ``load_format="dummy"`` gives the same shape with seeded random weights.

``model_dir`` also takes a Hugging Face hub id (``org/name``), as SGLang does: the checkpoint's config,
tokenizer and safetensors files are fetched with ``huggingface_hub`` into its cache (``HF_HOME``; with
``HF_HUB_OFFLINE=1`` only the cache is read).
"""

from __future__ import annotations

import os
from pathlib import Path

TINY_MODEL_DIR = Path(__file__).parent / "tiny_qwen3_5_moe"


# what a checkpoint folder needs: config, generation config, tokenizer, chat template, weights
HUB_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken")


def model_dir(path: str | os.PathLike | None, revision: str | None = None) -> str:
    """The checkpoint folder ``path`` names: a local folder, the built-in tiny model's when it names none, or the
    snapshot of a Hugging Face hub id (at ``revision``, default the main branch)."""
    if not path:
        return str(TINY_MODEL_DIR)
    path = os.fspath(path)
    if os.path.isdir(path) or not is_hub_id(path):
        return path
    return hub_snapshot(path, revision)


def is_hub_id(path: str) -> bool:
    """``org/name``: two non-empty parts, neither a path-like one."""
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "~")) and "\\" not in path


def hub_snapshot(repo_id: str, revision: str | None = None) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    # HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE as they are now (huggingface_hub reads them once, at import)
    home = os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))
    cache_dir = os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub")
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    try:
        return snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=list(HUB_PATTERNS),
            cache_dir=cache_dir,
            local_files_only=offline,
        )
    except LocalEntryNotFoundError as error:
        raise FileNotFoundError(
            f"model_path {repo_id!r}: no such folder here, and not in the Hugging Face cache "
            f"({cache_dir}); it cannot be downloaded (offline or no network): {error}"
        ) from None
