"""Block-FP8 weights at load: the checkpoint's scales, the tensors ``--quantization fp8`` quantizes itself, and one
shard of a quantized tensor into the model.

A quantized checkpoint tensor is an FP8 ``weight`` with a float32 ``weight_scale_inv`` beside it (checked against
the checkpoint's ``QuantConfig``). Online FP8 (``--quantization fp8`` on a checkpoint without quantization_config)
quantizes each high-precision matrix an FP8 layer can hold, as the export of a block-FP8 checkpoint would: in
e4m3 blocks of the config's ``block_size`` laid over the whole checkpoint tensor, so each shard reads the same
values as it would from the released checkpoint. A shard is read with the blocks it touches and either
dequantized, exactly, into a high-precision parameter (the CPU path), or, into a parameter kept FP8
(``layers/quant.py``), copied with its scales: that needs its rows and columns to start on block boundaries of both
the checkpoint tensor and the parameter, which ``check_alignment`` makes sure of before anything is read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from safetensors import safe_open

from sglang_lite.config import QuantConfig
from sglang_lite.kernels.quant import dequantize_blocks, e4m3fn_to_e4m3fnuz, quantize_blocks
from sglang_lite.layers.linear import Shard
from sglang_lite.layers.quant import SCALE_SUFFIX, scale_shape
from sglang_lite.models.checkpoint import CheckpointError, TensorInfo

logger = logging.getLogger(__name__)

Files = dict[str, TensorInfo]  # the model's name for a checkpoint tensor -> the tensor
Targets = dict[str, list[Shard]]  # the model's name for a checkpoint tensor -> the shards it fills
# quantized tensor -> its whole block scales (float32), or None: quantized at load from high precision
Quantized = dict[str, "torch.Tensor | None"]

UNUSED_SCALES = (".k_scale", ".v_scale", ".input_scale")
PER_TENSOR_SCALE = ".weight_scale"
HIGH_PRECISION = ("F64", "F32", "F16", "BF16")
NAMES_SHOWN = 3


def skip_unused_scales(files: Files, targets: Targets) -> None:
    """Drops from ``files``, with one warning, the scales some FP8 exports carry that nothing here can use: KV-cache
    scales (``k_scale``, ``v_scale``: the KV cache is kept in the model's dtype), static activation scales
    (``input_scale``: activations are quantized per token group at run time) and per-tensor weight scales (a
    one-element ``weight_scale``: block-FP8 weights carry their ``weight_scale_inv``). Only those of a module
    the model has; any other tensor the model does not expect stays, to be refused."""
    candidates = [name for name, info in files.items() if _unused_scale(info)]
    if not candidates:
        return
    modules = _module_prefixes(targets)
    unused = [name for name in candidates if {_owner(name), _owner(_owner(name))} & modules]
    if not unused:
        return
    shown = ", ".join(repr(files[name].raw) for name in unused[:NAMES_SHOWN])
    logger.warning(
        "skipping %d scale tensors no kernel here uses (%s%s): KV-cache scales (k_scale, v_scale; the KV cache "
        "is kept in the model dtype), static activation scales (input_scale; activations are quantized per "
        "token group at run time) and per-tensor weight scales (weight_scale; block-FP8 weights use "
        "weight_scale_inv)",
        len(unused),
        shown,
        ", ..." if len(unused) > NAMES_SHOWN else "",
    )
    for name in unused:
        del files[name]


def _unused_scale(info: TensorInfo) -> bool:
    per_tensor = info.raw.endswith(PER_TENSOR_SCALE) and info.numel == 1
    return per_tensor or info.raw.endswith(UNUSED_SCALES)


def _owner(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _module_prefixes(targets: Targets) -> set[str]:
    """Every dotted module prefix of the checkpoint names the model expects (``model.layers.0.self_attn``, ...)."""
    prefixes = set()
    for name in targets:
        parts = name.split(".")
        prefixes.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return prefixes


def take_scales(files: Files, quant: QuantConfig | None) -> dict[str, torch.Tensor]:
    """Removes the ``..._scale_inv`` tensors from ``files`` and returns them (float32, whole) by the name of the
    weight they scale, each checked (from the headers) against its weight's shape and the config first."""
    names = sorted(name for name in files if name.endswith(SCALE_SUFFIX))
    if not names:
        return {}
    if quant is None:
        first = files[names[0]]
        raise CheckpointError(
            f"unexpected tensor {first.raw!r} in {first.file}: a block-FP8 weight scale, but config.json has "
            f"no quantization_config ({len(names)} scales in all)"
        )
    for name in names:
        _check_scale(files, name.removesuffix(SCALE_SUFFIX), quant)
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name].file, []).append(name)
    scales = {}
    for file, file_names in by_file.items():
        with safe_open(file, "pt") as f:
            for name in file_names:
                scales[name.removesuffix(SCALE_SUFFIX)] = f.get_tensor(files.pop(name).raw).float()
    return scales


def _check_scale(files: Files, weight: str, quant: QuantConfig) -> None:
    scale = files[weight + SCALE_SUFFIX]
    if weight not in files:
        raise CheckpointError(
            f"unexpected tensor {scale.raw!r} in {scale.file}: a scale without its weight {weight!r}"
        )
    info = files[weight]
    if not quant.converts(info.raw.removesuffix(".weight")):
        raise CheckpointError(
            f"tensor {info.raw!r} in {info.file} is quantized ({scale.raw!r} beside it), but "
            "quantization_config.modules_to_not_convert lists it"
        )
    expected = scale_shape(info.shape, quant.block_size)
    if scale.shape != expected:
        rows, cols = quant.block_size
        raise CheckpointError(
            f"shape mismatch for tensor {scale.raw!r} in {scale.file}: expected {expected} (the "
            f"{rows}x{cols} blocks of {info.raw!r} {info.shape}), found {scale.shape}"
        )


def check_fp8_has_scales(files: Files, quantized: Quantized) -> None:
    for name, info in files.items():
        if info.is_fp8 and name not in quantized:
            raise CheckpointError(
                f"tensor {info.raw!r} in {info.file} is FP8 ({info.dtype}) but has no "
                f"{info.raw + SCALE_SUFFIX!r} beside it"
            )


def online_quantized(
    files: Files, targets: Targets, fp8_capable: set[str], quant: QuantConfig
) -> Quantized:
    """The high-precision tensors online FP8 quantizes: each matrix (or stack of them) the config converts whose
    every shard fills a parameter an FP8 layer can hold (``layers/quant.py``'s ``fp8_capable_parameters``)."""
    return {
        name: None
        for name, info in files.items()
        if len(info.shape) >= 2
        and info.dtype in HIGH_PRECISION
        and quant.converts(info.raw.removesuffix(".weight"))
        and all(shard.param in fp8_capable for shard in targets[name])
    }


def fp8_parameters(files: Files, targets: Targets, quantized: Quantized) -> set[str]:
    """The parameters every checkpoint tensor filling them is quantized: those can stay FP8."""
    sources: dict[str, list[str]] = {}
    for name, shards in targets.items():
        for shard in shards:
            sources.setdefault(shard.param, []).append(name)
    return {
        param
        for param, names in sources.items()
        if all(n in quantized for n in names if n in files)
    }


def check_alignment(files: Files, targets: Targets, params: dict, block: tuple[int, int]) -> None:
    """Refuses, before anything is read, a shard bound for a parameter kept FP8 that does not cover whole blocks of
    both the checkpoint tensor and the parameter (as upstream SGLang refuses partitions that are not multiples of
    the block): the blocks it shares would be quantized a second time."""
    for name in sorted(files):
        info = files[name]
        for shard in targets[name]:
            param = params[shard.param]
            if _is_fp8(param) and not _shard_aligned(info, shard, tuple(param.shape), block):
                param_shape = tuple(param.shape)
                src = _spans(_full_index(shard.source, info.shape), info.shape)
                dest = _spans(_full_index(shard.index, param_shape), param_shape)
                raise _misaligned(info, shard.param, param_shape, src, dest, block)


def aligned_parameters(
    files: Files, targets: Targets, params: dict, candidates: set[str], block: tuple[int, int]
) -> set[str]:
    """The ``candidates`` every shard of which covers whole blocks of its checkpoint tensor and of the parameter:
    those can be kept FP8 (``check_alignment`` would refuse the others)."""
    misaligned = {
        shard.param
        for name, info in files.items()
        for shard in targets[name]
        if shard.param in candidates
        and not _shard_aligned(info, shard, tuple(params[shard.param].shape), block)
    }
    return candidates - misaligned


def _shard_aligned(
    info: TensorInfo, shard: Shard, param_shape: tuple[int, ...], block: tuple[int, int]
) -> bool:
    src = _spans(_full_index(shard.source, info.shape), info.shape)
    dest = _spans(_full_index(shard.index, param_shape), param_shape)
    ends = zip(src, dest, info.shape[-2:], param_shape[-2:], block)
    return all(_aligned(s, d, s_end, d_end, size) for s, d, s_end, d_end, size in ends)


def _misaligned(
    info: TensorInfo,
    param: str,
    param_shape: tuple[int, ...],
    src: list[tuple[int, int]],
    dest: list[tuple[int, int]],
    block: tuple[int, int],
) -> CheckpointError:
    rows, cols = src
    size = (rows[1] - rows[0], cols[1] - cols[0])
    return CheckpointError(
        f"tensor {info.raw!r} {info.shape} in {info.file} loads as block-FP8 in {block[0]}x{block[1]} blocks, "
        f"but this rank's shard of it (rows {rows[0]}:{rows[1]}, columns {cols[0]}:{cols[1]}: shard size "
        f"{size}) goes to rows {dest[0][0]}:{dest[0][1]}, columns {dest[1][0]}:{dest[1][1]} of parameter "
        f"{param!r} {param_shape}, not on {block[0]}x{block[1]} block boundaries of both: kept FP8, the blocks "
        "it shares would be quantized a second time. Use a tensor-parallel size whose shards are multiples "
        "of the block, or --quantization none (weights in --dtype: an FP8 checkpoint dequantized at load)"
    )


@dataclass(frozen=True)
class QuantizedRead:
    """The blocks one shard of a quantized tensor touches: ``values`` (e4m3fn) with their ``scales``; the shard
    starts ``offset`` (rows, columns) into them and spans ``size``."""

    values: torch.Tensor
    scales: torch.Tensor
    offset: tuple[int, int]
    size: tuple[int, int]


def read_quantized(
    tensor, info: TensorInfo, scale: torch.Tensor | None, source: tuple, block: tuple[int, int]
) -> QuantizedRead:
    """``tensor[source]`` (a safetensors slice) with the blocks it touches: read as they are with their ``scale``
    entries, or, when ``scale`` is None, quantized now over the blocks of the whole tensor."""
    index = _full_index(source, info.shape)
    spans = _spans(index, info.shape)
    blocks = _block_slices(spans, block)
    region = tuple(
        slice(b.start * size, min(b.stop * size, n))
        for b, size, n in zip(blocks, block, info.shape[-2:])
    )
    lead = index[:-2]
    if scale is None:
        values, scales = quantize_blocks(tensor[lead + region], block, torch.float8_e4m3fn)
    else:
        values, scales = tensor[lead + region], scale[lead + blocks]
    offset = tuple(start - r.start for (start, _), r in zip(spans, region))
    return QuantizedRead(values, scales, offset, tuple(stop - start for start, stop in spans))


def load_quantized(read: QuantizedRead, shard: Shard, params: dict, block: tuple[int, int]) -> None:
    """One shard into its parameter: dequantized (exactly) into a high-precision one, or copied with its scales
    into an FP8 one (``check_alignment`` made sure its blocks are the parameter's)."""
    param = params[shard.param]
    if not _is_fp8(param):
        rows = slice(read.offset[0], read.offset[0] + read.size[0])
        cols = slice(read.offset[1], read.offset[1] + read.size[1])
        param.data[shard.index].copy_(
            dequantize_blocks(read.values, read.scales, block)[..., rows, cols]
        )
        return
    values, scales = read.values, read.scales
    if param.dtype == torch.float8_e4m3fnuz:
        values, scales = e4m3fn_to_e4m3fnuz(values, scales)
    index = _full_index(shard.index, tuple(param.shape))
    param.data[index].copy_(values)
    blocks = _block_slices(_spans(index, tuple(param.shape)), block)
    params[shard.param + SCALE_SUFFIX].data[index[:-2] + blocks].copy_(scales)


def _is_fp8(param: torch.Tensor) -> bool:
    return param.dtype.is_floating_point and param.element_size() == 1


def _full_index(index: tuple, shape: tuple[int, ...]) -> tuple:
    """``index`` padded with whole slices to one entry per dimension (its last two entries are slices)."""
    return tuple(index) + (slice(None),) * (len(shape) - len(index))


def _spans(index: tuple, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """The [start, stop) element spans of a full index's last two (slice) entries."""
    return [s.indices(n)[:2] for s, n in zip(index[-2:], shape[-2:])]


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
