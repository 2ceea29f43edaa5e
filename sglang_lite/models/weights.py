"""Reading Hugging Face safetensors checkpoints into the model's (packed) parameters.

Names are normalised first (``model.language_model.`` -> ``model.``; vision tower and MTP head skipped), then
matched one to one against the checkpoint names the model expects, which each layer declares through
``packed_shards`` (an MoE block declares its experts apart, in either checkpoint layout: ``per_expert_shards``,
``fused_expert_shards``). A tensor-parallel rank reads only its slices of each tensor (``safe_open.get_slice``), and
nothing of another rank's experts. Anything missing, unexpected or mis-shaped raises ``CheckpointError`` naming the
tensor.
"""
from __future__ import annotations

import json
import os

from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from sglang_lite.layers.linear import Shard, ShardMap

SKIPPED_PREFIXES = ("model.visual.", "mtp.", "visual.")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: the message names the tensor, the shapes and the file."""


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


def expected_targets(model: nn.Module, fused_experts: bool) -> dict[str, list[Shard]]:
    """Every checkpoint name the model needs, and the shards (model parameter names) its tensor fills.
    ``fused_experts``: the checkpoint stores each MoE block's experts as two stacked tensors (transformers' fused
    layout), not one set of matrices each. A parameter shared by two modules (a tied LM head) loads once, under the
    name ``named_parameters`` keeps."""
    params = {name for name, _ in model.named_parameters()}
    targets = {name: [Shard(name)] for name in params}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        declared = _declared_shards(module, fused_experts)
        if any(prefix + s.param not in params for shards in declared.values() for s in shards):
            continue  # the module's parameter is another's (tied): declared there
        for shards in declared.values():
            for shard in shards:
                targets.pop(prefix + shard.param, None)
        for ckpt_name, shards in declared.items():
            targets[prefix + ckpt_name] = [Shard(prefix + s.param, s.index, s.source) for s in shards]
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
    files: dict[str, tuple[str, str]], targets: dict[str, list[Shard]], params: dict, path: str
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
        shards = targets[missing[0]]
        shape = tuple(params[shards[0].param].data[shards[0].index].shape) if shards else "this rank reads none"
        raise CheckpointError(
            f"missing tensor {missing[0]!r} (expected shape {shape}, found none) in checkpoint {path} "
            f"({len(missing)} missing in all)"
        )


def _load_file(
    file: str, names: list[str], files: dict[str, tuple[str, str]], targets: dict[str, list[Shard]], params: dict
) -> None:
    with safe_open(file, "pt") as f:
        for name in names:
            raw = files[name][0]
            for shard in targets[name]:
                dest = params[shard.param].data[shard.index]
                tensor = f.get_slice(raw)
                found = _sliced_shape(tuple(tensor.get_shape()), shard.source)
                if found != tuple(dest.shape):
                    what = f" (this rank's slice {_describe(shard.source)} of {tuple(tensor.get_shape())})" \
                        if shard.source else ""
                    raise CheckpointError(f"shape mismatch for tensor {raw!r} in {file}: expected "
                                          f"{tuple(dest.shape)}, found {found}{what}")
                dest.copy_(tensor[shard.source] if shard.source else f.get_tensor(raw))


def _sliced_shape(shape: tuple[int, ...], source: tuple) -> tuple[int, ...]:
    """The shape of ``tensor[source]`` for a tensor of ``shape``, without reading it (an overrun is visible: a
    slice past the end shortens the result, as indexing does)."""
    out = [len(range(*s.indices(n))) for s, n in zip(source, shape)]
    return (*out, *shape[len(source):])


def _describe(source: tuple) -> str:
    return "[" + ", ".join(":" if s == slice(None) else f"{s.start}:{s.stop}" for s in source) + "]"
