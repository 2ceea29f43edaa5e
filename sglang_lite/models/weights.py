"""Reading Hugging Face safetensors checkpoints into the model's (packed) parameters.

Names are normalised first (``model.language_model.`` -> ``model.``; vision tower and MTP head skipped), then
matched one to one against the checkpoint names the model expects, which each layer declares through
``packed_shards`` (an MoE block declares its experts apart, in either checkpoint layout: ``per_expert_shards``,
``fused_expert_shards``). A tensor-parallel rank reads only its slices of each tensor (``safe_open.get_slice``), and
nothing of another rank's experts. Anything missing, unexpected or mis-shaped raises ``CheckpointError`` naming the
tensor.

Block-FP8 checkpoints (``quantization_config``): a weight with a ``weight_scale_inv`` beside it is quantized (read
from the checkpoint, checked against the config). Each of its shards is read with the scales of the blocks it
touches and either dequantized, exactly, into the compute dtype (the CPU path), or, into a parameter kept in FP8
(``layers/quant.py``, on a GPU), copied as FP8 bytes with its scales when its rows and columns start on block
boundaries in both tensors, else requantized over the parameter's blocks it overlaps (lossy; real checkpoints'
sizes are multiples of the block).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from sglang_lite.config import QuantConfig
from sglang_lite.kernels.quant import dequantize_blocks, e4m3fn_to_e4m3fnuz, quantize_blocks
from sglang_lite.layers.linear import Shard, ShardMap
from sglang_lite.layers.quant import SCALE_SUFFIX, convert_to_fp8, scale_shape

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
            targets[prefix + ckpt_name] = [
                Shard(prefix + s.param, s.index, s.source) for s in shards
            ]
    return targets


def _declared_shards(module: nn.Module, fused_experts: bool) -> ShardMap:
    """The checkpoint tensors ``module`` packs into its own parameters; an MoE block's experts in the layout the
    checkpoint uses."""
    shards: ShardMap = module.packed_shards() if hasattr(module, "packed_shards") else {}
    if hasattr(module, "per_expert_shards"):
        shards = shards | (
            module.fused_expert_shards() if fused_experts else module.per_expert_shards()
        )
    return shards


def load_checkpoint(
    model: nn.Module,
    path: str,
    tied_lm_head: bool,
    quant: QuantConfig | None = None,
    fp8_dtype: torch.dtype | None = None,
) -> None:
    """Fills ``model`` from the checkpoint at ``path``. ``quant``: the checkpoint's quantization_config (its
    quantized tensors are checked against it); ``fp8_dtype``: keep the quantized projections in this FP8 format
    (None: dequantize them into the model's dtype)."""
    files = {}
    for raw, file in checkpoint_files(path).items():
        name = normalise_name(raw)
        if name is not None:
            files[name] = (raw, file)
    if tied_lm_head:
        files.pop("lm_head.weight", None)  # a tied head is the embedding; a saved copy is redundant
    scales = _take_scales(files, quant)
    fused = any(name.endswith("mlp.experts.gate_up_proj") for name in files)
    targets = expected_targets(model, fused)
    params = dict(model.named_parameters())
    _check_names(files, targets, params, path)
    if scales and fp8_dtype is not None:
        convert_to_fp8(model, _fp8_parameters(files, targets, scales), quant.block_size, fp8_dtype)
        params = dict(model.named_parameters())
    block = quant.block_size if quant else None
    by_file: dict[str, list[str]] = {}
    for name, (_, file) in files.items():
        by_file.setdefault(file, []).append(name)
    with tqdm(
        total=len(files), desc="Loading weights", unit="tensor", disable=len(files) < 200
    ) as bar:
        for file, names in by_file.items():
            _load_file(file, names, files, targets, params, scales, block)
            bar.update(len(names))


def _take_scales(
    files: dict[str, tuple[str, str]], quant: QuantConfig | None
) -> dict[str, torch.Tensor]:
    """Removes the ``..._scale_inv`` tensors from ``files`` and returns them (float32, whole) by the name of the
    weight they scale, each checked against its weight's shape and the config."""
    names = sorted(name for name in files if name.endswith(SCALE_SUFFIX))
    if not names:
        return {}
    if quant is None:
        raw, file = files[names[0]]
        raise CheckpointError(
            f"unexpected tensor {raw!r} in {file}: a block-FP8 weight scale, but config.json has "
            f"no quantization_config ({len(names)} scales in all)"
        )
    scales, by_file = {}, {}
    for name in names:
        by_file.setdefault(files[name][1], []).append(name)
    for file, file_names in by_file.items():
        with safe_open(file, "pt") as f:
            for name in file_names:
                scales[name.removesuffix(SCALE_SUFFIX)] = f.get_tensor(files[name][0]).float()
    for weight, scale in scales.items():
        _check_scale(files, weight, scale, quant)
        files.pop(weight + SCALE_SUFFIX)
    return scales


def _check_scale(
    files: dict[str, tuple[str, str]], weight: str, scale: torch.Tensor, quant: QuantConfig
) -> None:
    raw_scale, file = files[weight + SCALE_SUFFIX]
    if weight not in files:
        raise CheckpointError(
            f"unexpected tensor {raw_scale!r} in {file}: a scale without its weight {weight!r}"
        )
    raw = files[weight][0]
    if not quant.converts(raw.removesuffix(".weight")):
        raise CheckpointError(
            f"tensor {raw!r} in {files[weight][1]} is quantized ({raw_scale!r} beside it), but "
            "quantization_config.modules_to_not_convert lists it"
        )
    with safe_open(files[weight][1], "pt") as f:
        shape = tuple(f.get_slice(raw).get_shape())
    expected = scale_shape(shape, quant.block_size)
    if tuple(scale.shape) != expected:
        raise CheckpointError(
            f"shape mismatch for tensor {raw_scale!r} in {file}: expected {expected} (the "
            f"{quant.block_size[0]}x{quant.block_size[1]} blocks of {raw!r} {shape}), found "
            f"{tuple(scale.shape)}"
        )


def _fp8_parameters(
    files: dict[str, tuple[str, str]],
    targets: dict[str, list[Shard]],
    scales: dict[str, torch.Tensor],
) -> set[str]:
    """The parameters every checkpoint tensor filling them is quantized: those can stay FP8."""
    sources: dict[str, list[str]] = {}
    for name, shards in targets.items():
        for shard in shards:
            sources.setdefault(shard.param, []).append(name)
    return {
        param for param, names in sources.items() if all(n in scales for n in names if n in files)
    }


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
        shape = (
            tuple(params[shards[0].param].data[shards[0].index].shape)
            if shards
            else "this rank reads none"
        )
        raise CheckpointError(
            f"missing tensor {missing[0]!r} (expected shape {shape}, found none) in checkpoint {path} "
            f"({len(missing)} missing in all)"
        )


def _load_file(
    file: str,
    names: list[str],
    files: dict[str, tuple[str, str]],
    targets: dict[str, list[Shard]],
    params: dict,
    scales: dict[str, torch.Tensor] | None = None,
    block: tuple[int, int] | None = None,
) -> None:
    scales = scales or {}
    with safe_open(file, "pt") as f:
        for name in names:
            raw = files[name][0]
            if name not in scales and f.get_slice(raw).get_dtype().startswith("F8"):
                raise CheckpointError(
                    f"tensor {raw!r} in {file} is FP8 ({f.get_slice(raw).get_dtype()}) but has no "
                    f"{raw + SCALE_SUFFIX!r} beside it"
                )
            for shard in targets[name]:
                dest = params[shard.param].data[shard.index]
                tensor = f.get_slice(raw)
                found = _sliced_shape(tuple(tensor.get_shape()), shard.source)
                if found != tuple(dest.shape):
                    what = (
                        f" (this rank's slice {_describe(shard.source)} of {tuple(tensor.get_shape())})"
                        if shard.source
                        else ""
                    )
                    raise CheckpointError(
                        f"shape mismatch for tensor {raw!r} in {file}: expected "
                        f"{tuple(dest.shape)}, found {found}{what}"
                    )
                if name in scales:
                    _load_quantized(tensor, scales[name], shard, params, block)
                else:
                    dest.copy_(tensor[shard.source] if shard.source else f.get_tensor(raw))


def _load_quantized(
    tensor, scale: torch.Tensor, shard: Shard, params: dict, block: tuple[int, int]
) -> None:
    """One shard of a block-FP8 checkpoint tensor: dequantized into a high-precision parameter, or into an FP8
    one (with its ``_scale_inv`` companion) as it is when the blocks line up, else requantized."""
    param = params[shard.param]
    shape = tuple(tensor.get_shape())
    source = _full_index(shard.source, shape)
    if not param.dtype.is_floating_point or param.element_size() != 1:
        param.data[shard.index].copy_(_dequantized(tensor, scale, shape, source, block))
        return
    param_scale = params[shard.param + SCALE_SUFFIX]
    index = _full_index(shard.index, tuple(param.shape))
    src_spans = [s.indices(n)[:2] for s, n in zip(source[-2:], shape[-2:])]
    dest_spans = [s.indices(n)[:2] for s, n in zip(index[-2:], param.shape[-2:])]
    ends = zip(src_spans, dest_spans, shape[-2:], param.shape[-2:], block)
    if all(_aligned(src, dest, s_end, d_end, size) for src, dest, s_end, d_end, size in ends):
        fp8, fp8_scale = tensor[source], scale[source[:-2] + _block_slices(src_spans, block)]
        if param.dtype == torch.float8_e4m3fnuz:
            fp8, fp8_scale = e4m3fn_to_e4m3fnuz(fp8, fp8_scale)
        param.data[index].copy_(fp8)
        param_scale.data[index[:-2] + _block_slices(dest_spans, block)].copy_(fp8_scale)
        return
    _requantize_into(
        param,
        param_scale,
        index,
        dest_spans,
        _dequantized(tensor, scale, shape, source, block),
        block,
    )


def _requantize_into(
    param: torch.Tensor,
    param_scale: torch.Tensor,
    index: tuple,
    spans: list[tuple[int, int]],
    values: torch.Tensor,
    block: tuple[int, int],
) -> None:
    """Writes float32 ``values`` into ``param[index]`` (FP8): the whole blocks they touch are dequantized, updated
    and quantized again, so the shards that share a block with this one keep their values (up to rounding)."""
    blocks = _block_slices(spans, block)
    region = tuple(
        slice(b.start * size, min(b.stop * size, n))
        for b, size, n in zip(blocks, block, param.shape[-2:])
    )
    lead = index[:-2]
    current = dequantize_blocks(
        param.data[lead + region], param_scale.data[lead + blocks], block
    ).cpu()
    (r0, r1), (c0, c1) = spans
    current[
        ...,
        r0 - region[0].start : r1 - region[0].start,
        c0 - region[1].start : c1 - region[1].start,
    ] = values
    fp8, fp8_scale = quantize_blocks(current, block, param.dtype)
    param.data[lead + region].copy_(fp8)
    param_scale.data[lead + blocks].copy_(fp8_scale)


def _dequantized(
    tensor, scale: torch.Tensor, shape: tuple[int, ...], source: tuple, block: tuple[int, int]
) -> torch.Tensor:
    """float32 ``tensor[source]`` times the scales of its blocks (a slice may start or end inside a block)."""
    spans = [s.indices(n)[:2] for s, n in zip(source[-2:], shape[-2:])]
    part = scale[source[:-2] + _block_slices(spans, block)]
    expanded = part.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    (r0, r1), (c0, c1) = spans
    offsets = [start % size for (start, _), size in zip(spans, block)]
    expanded = expanded[..., offsets[0] : offsets[0] + r1 - r0, offsets[1] : offsets[1] + c1 - c0]
    return tensor[source].float() * expanded


def _full_index(index: tuple, shape: tuple[int, ...]) -> tuple:
    """``index`` padded with whole slices to one entry per dimension (its last two entries are slices)."""
    return tuple(index) + (slice(None),) * (len(shape) - len(index))


def _block_slices(spans: list[tuple[int, int]], block: tuple[int, int]) -> tuple[slice, slice]:
    """The blocks of each dimension that the element spans [start, stop) touch."""
    return tuple(
        slice(start // size, -(-stop // size)) for (start, stop), size in zip(spans, block)
    )


def _aligned(
    src: tuple[int, int], dest: tuple[int, int], src_end: int, dest_end: int, size: int
) -> bool:
    """Source and destination blocks coincide: both spans start on a block boundary and either span whole blocks
    or run to the end of both tensors (where the last block may be partial in both)."""
    starts_ok = src[0] % size == 0 and dest[0] % size == 0
    return starts_ok and (
        (src[1] - src[0]) % size == 0 or (src[1] == src_end and dest[1] == dest_end)
    )


def _sliced_shape(shape: tuple[int, ...], source: tuple) -> tuple[int, ...]:
    """The shape of ``tensor[source]`` for a tensor of ``shape``, without reading it (an overrun is visible: a
    slice past the end shortens the result, as indexing does)."""
    out = [len(range(*s.indices(n))) for s, n in zip(source, shape)]
    return (*out, *shape[len(source) :])


def _describe(source: tuple) -> str:
    return "[" + ", ".join(":" if s == slice(None) else f"{s.start}:{s.stop}" for s in source) + "]"
