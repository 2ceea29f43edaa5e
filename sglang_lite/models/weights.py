"""Reading Hugging Face safetensors checkpoints into the model's (packed) parameters.

Names are normalised first (``model.language_model.`` -> ``model.``; vision tower and MTP head skipped), then
matched one to one against the checkpoint names the model expects, which each layer declares through
``packed_shards`` (an MoE block declares its experts apart, in either checkpoint layout: ``per_expert_shards``,
``fused_expert_shards``). Anything missing, unexpected or mis-shaped raises ``CheckpointError`` naming the tensor.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from sglang_lite.layers.linear import ShardMap

SKIPPED_PREFIXES = ("model.visual.", "mtp.", "visual.")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: the message names the tensor, the shapes and the file."""


@dataclass(frozen=True)
class Target:
    param: str  # parameter name in the model
    index: tuple  # the part of the parameter this checkpoint tensor fills


def checkpoint_files(path: str) -> dict[str, str]:
    """Maps each (raw) tensor name to the safetensors file holding it: a single file or a sharded index."""
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, SINGLE_FILE)
    if not os.path.exists(single):
        raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
    with safe_open(single, "pt") as f:
        return {name: single for name in f.keys()}


def normalise_name(name: str) -> str | None:
    """The model's name for a checkpoint tensor, or None for tensors text-only serving skips."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


def expected_targets(model: nn.Module, fused_experts: bool) -> dict[str, Target]:
    """Every checkpoint name the model needs, and where its tensor goes. ``fused_experts``: the checkpoint stores
    each MoE block's experts as two stacked tensors (transformers' fused layout), not one set of matrices each."""
    targets = {name: Target(name, ()) for name, _ in model.named_parameters()}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for ckpt_name, (param, index) in _declared_shards(module, fused_experts).items():
            targets.pop(prefix + param, None)
            targets[prefix + ckpt_name] = Target(prefix + param, index)
    return targets


def _declared_shards(module: nn.Module, fused_experts: bool) -> ShardMap:
    """The checkpoint tensors ``module`` packs into its own parameters; an MoE block's experts in the layout the
    checkpoint uses."""
    shards: ShardMap = module.packed_shards() if hasattr(module, "packed_shards") else {}
    if hasattr(module, "per_expert_shards"):
        shards = shards | (module.fused_expert_shards() if fused_experts else module.per_expert_shards())
    return shards


def load_checkpoint(model: nn.Module, path: str, tied_lm_head: bool) -> None:
    files = {}
    for raw, file in checkpoint_files(path).items():
        name = normalise_name(raw)
        if name is not None:
            files[name] = (raw, file)
    if tied_lm_head:
        files.pop("lm_head.weight", None)  # a tied head is the embedding; a saved copy is redundant
    fused = any(name.endswith("mlp.experts.gate_up_proj") for name in files)
    targets = expected_targets(model, fused)
    params = dict(model.named_parameters())
    _check_names(files, targets, params, path)
    by_file: dict[str, list[str]] = {}
    for name, (_, file) in files.items():
        by_file.setdefault(file, []).append(name)
    with tqdm(total=len(files), desc="Loading weights", unit="tensor", disable=len(files) < 200) as bar:
        for file, names in by_file.items():
            _load_file(file, names, files, targets, params)
            bar.update(len(names))


def _check_names(
    files: dict[str, tuple[str, str]], targets: dict[str, Target], params: dict, path: str
) -> None:
    unexpected = sorted(set(files) - set(targets))
    if unexpected:
        raw, file = files[unexpected[0]]
        with safe_open(file, "pt") as f:
            found = tuple(f.get_slice(raw).get_shape())
        raise CheckpointError(
            f"unexpected tensor {raw!r} (shape {found}) in {file}: the model expects no such weight "
            f"({len(unexpected)} unexpected in all)"
        )
    missing = sorted(set(targets) - set(files))
    if missing:
        target = targets[missing[0]]
        shape = tuple(params[target.param].data[target.index].shape)
        raise CheckpointError(
            f"missing tensor {missing[0]!r} (expected shape {shape}, found none) in checkpoint {path} "
            f"({len(missing)} missing in all)"
        )


def _load_file(
    file: str, names: list[str], files: dict[str, tuple[str, str]], targets: dict[str, Target], params: dict
) -> None:
    with safe_open(file, "pt") as f:
        for name in names:
            raw = files[name][0]
            target = targets[name]
            dest = params[target.param].data[target.index]
            found = tuple(f.get_slice(raw).get_shape())
            if found != tuple(dest.shape):
                raise CheckpointError(
                    f"shape mismatch for tensor {raw!r} in {file}: expected {tuple(dest.shape)}, found {found}"
                )
            dest.copy_(f.get_tensor(raw))
