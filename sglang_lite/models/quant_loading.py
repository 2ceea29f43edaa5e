"""Quantized weights at load: the checkpoint's scales, the tensors ``--quantization`` quantizes itself, and one
shard of a quantized tensor into the model, for every scheme of the quantization seam (``quantization/``).

A quantized checkpoint tensor has its scales beside it (``weight_scale_inv`` for block FP8, ``weight_scale`` for
Quark's MXFP4: the config's ``scale_suffix``), each checked against the scheme the config gives its module. Its
shape is read as the logical one ([out, in], MXFP4's two codes a byte unpacked), which the model's parameters
have. Online quantization (``--quantization fp8|mxfp4`` on a checkpoint without quantization_config) quantizes
each high-precision matrix a quantized layer can hold, as an export of the checkpoint would: in blocks laid over
the whole checkpoint tensor, so each shard reads the same values it would from the exported checkpoint. A shard is
read with the blocks it touches and either dequantized, exactly, into a high-precision parameter, or, into a
parameter kept quantized (``layers/quant.py``), copied with its scales: that needs its rows and columns to start
on block boundaries of both the checkpoint tensor and the parameter, which ``check_alignment`` makes sure of before
anything is read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from safetensors import safe_open

from sglang_lite.layers.linear import Shard
from sglang_lite.models.checkpoint import CheckpointError, TensorInfo
from sglang_lite.quantization import QuantizationConfig, WeightScheme

logger = logging.getLogger(__name__)

Files = dict[str, TensorInfo]  # the model's name for a checkpoint tensor -> the tensor
Targets = dict[str, list[Shard]]  # the model's name for a checkpoint tensor -> the shards it fills


@dataclass(frozen=True)
class QuantizedTensor:
    """A checkpoint tensor read quantized: its scheme, and its whole scales (None: quantized at load from high
    precision)."""

    scheme: WeightScheme
    scales: torch.Tensor | None = None


Quantized = dict[
    str, QuantizedTensor
]  # the model's name for a checkpoint tensor -> how it is quantized

FP8_SCALE_SUFFIX = "_scale_inv"
MX_SCALE_SUFFIX = "_scale"
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
    # a one-element e8m0 (uint8) scale is MXFP4's of a one-row weight, not a per-tensor one
    per_tensor = info.raw.endswith(PER_TENSOR_SCALE) and info.numel == 1 and info.dtype != "U8"
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


def take_scales(files: Files, quant: QuantizationConfig | None) -> Quantized:
    """Removes the scale tensors (names ending with the config's ``scale_suffix``) from ``files`` and returns their
    weights as quantized (scales float32 or uint8, whole), each checked (from the headers) against its weight and
    the scheme the config gives its module first; a quantized weight's entry in ``files`` takes its logical shape.
    Without a config, a block-FP8 scale is refused."""
    suffix = quant.scale_suffix if quant is not None else FP8_SCALE_SUFFIX
    names = sorted(name for name in files if name.endswith(suffix) and _is_scale(files[name]))
    if not names:
        return {}
    if quant is None:
        first = files[names[0]]
        raise CheckpointError(
            f"unexpected tensor {first.raw!r} in {first.file}: a block-FP8 weight scale, but config.json has "
            f"no quantization_config ({len(names)} scales in all)"
        )
    schemes = {name: _check_scale(files, name.removesuffix(suffix), quant) for name in names}
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name].file, []).append(name)
    quantized = {}
    for file, file_names in by_file.items():
        with safe_open(file, "pt") as f:
            for name in file_names:
                scales = f.get_tensor(files.pop(name).raw)
                scheme = schemes[name]
                scales = scales.float() if scheme.scale_dtype == torch.float32 else scales
                weight = name.removesuffix(suffix)
                quantized[weight] = QuantizedTensor(scheme, scales)
                files[weight] = files[weight]._replace(
                    shape=scheme.logical_shape(files[weight].shape)
                )
    return quantized


def _is_scale(info: TensorInfo) -> bool:
    return info.dtype in ("F32", "U8", "BF16", "F16")


def _module(raw: str) -> str:
    """The module a checkpoint weight belongs to (a fused expert stack is its own)."""
    return raw.removesuffix(".weight")


def _check_scale(files: Files, weight: str, quant: QuantizationConfig) -> WeightScheme:
    scale = files[weight + quant.scale_suffix]
    if weight not in files:
        raise CheckpointError(
            f"unexpected tensor {scale.raw!r} in {scale.file}: a scale without its weight {weight!r}"
        )
    info = files[weight]
    scheme = quant.scheme_for(_module(info.raw))
    if scheme is None:
        raise CheckpointError(
            f"tensor {info.raw!r} in {info.file} is quantized ({scale.raw!r} beside it), but "
            f"quantization_config.{quant.exclusion_field} lists it"
        )
    if not _stored_as(info, scheme):
        raise CheckpointError(
            f"tensor {info.raw!r} in {info.file} has dtype {info.dtype}, but its scheme "
            f"({scheme.describe()}) stores {scheme.stored_dtype('cpu')}"
        )
    logical = scheme.logical_shape(info.shape)
    expected = scheme.scale_shape(logical)
    if scale.shape != expected:
        rows, cols = scheme.block
        raise CheckpointError(
            f"shape mismatch for tensor {scale.raw!r} in {scale.file}: expected {expected} (the "
            f"{rows}x{cols} blocks of {info.raw!r} {logical}), found {scale.shape}"
        )
    return scheme


def _stored_as(info: TensorInfo, scheme: WeightScheme) -> bool:
    return info.is_fp8 if scheme.stored_dtype("cpu").is_floating_point else info.dtype == "U8"


def check_has_scales(files: Files, quantized: Quantized) -> None:
    """Refuses an FP8 or packed MXFP4 (uint8) weight without its scales."""
    for name, info in files.items():
        if (info.is_fp8 or info.dtype == "U8") and name not in quantized:
            kind, suffix = (
                ("FP8", FP8_SCALE_SUFFIX) if info.is_fp8 else ("packed MXFP4", MX_SCALE_SUFFIX)
            )
            raise CheckpointError(
                f"tensor {info.raw!r} in {info.file} is {kind} ({info.dtype}) but has no "
                f"{info.raw + suffix!r} beside it that the checkpoint's quantization_config describes"
            )


def online_quantized(
    files: Files, targets: Targets, capable: set[str], quant: QuantizationConfig
) -> Quantized:
    """The high-precision tensors online quantization quantizes: each matrix (or stack of them) whose module the
    config gives a scheme that can store it, and whose every shard fills a parameter a quantized layer can hold
    (``layers/quant.py``'s ``quantizable_parameters``)."""
    quantized = {}
    for name, info in files.items():
        scheme = quant.scheme_for(_module(info.raw)) if len(info.shape) >= 2 else None
        if (
            scheme is not None
            and info.dtype in HIGH_PRECISION
            and scheme.check_logical_shape(info.shape) is None
            and all(shard.param in capable for shard in targets[name])
        ):
            quantized[name] = QuantizedTensor(scheme)
    return quantized


def kept_parameters(
    files: Files, targets: Targets, quantized: Quantized
) -> dict[str, WeightScheme]:
    """The parameters that can stay quantized, with their scheme: every checkpoint tensor filling them is
    quantized, all in one scheme."""
    sources: dict[str, list[str]] = {}
    for name, shards in targets.items():
        for shard in shards:
            sources.setdefault(shard.param, []).append(name)
    kept = {}
    for param, names in sources.items():
        schemes = {quantized[n].scheme if n in quantized else None for n in names if n in files}
        if len(schemes) == 1 and None not in schemes:
            kept[param] = schemes.pop()
    return kept


def check_alignment(
    files: Files, targets: Targets, params: dict, kept: dict[str, WeightScheme]
) -> None:
    """Refuses, before anything is read, a shard bound for a parameter kept quantized that does not cover whole
    blocks of both the checkpoint tensor and the parameter (as upstream SGLang refuses partitions that are not
    multiples of the block): the blocks it shares would be quantized a second time (FP8), or a 32-group of MXFP4
    would be cut in two."""
    for name in sorted(files):
        info = files[name]
        for shard in targets[name]:
            scheme = kept.get(shard.param)
            if scheme is None:
                continue
            shape = scheme.logical_shape(tuple(params[shard.param].shape))
            if not _shard_aligned(info, shard, shape, scheme.block):
                src = _spans(_full_index(shard.source, info.shape), info.shape)
                dest = _spans(_full_index(shard.index, shape), shape)
                raise _misaligned(info, shard.param, shape, src, dest, scheme)


def aligned_parameters(
    files: Files, targets: Targets, params: dict, candidates: dict[str, WeightScheme]
) -> dict[str, WeightScheme]:
    """The ``candidates`` every shard of which covers whole blocks of its checkpoint tensor and of the parameter:
    those can be kept quantized (``check_alignment`` would refuse the others)."""
    misaligned = {
        shard.param
        for name, info in files.items()
        for shard in targets[name]
        if shard.param in candidates
        and not _shard_aligned(
            info, shard, tuple(params[shard.param].shape), candidates[shard.param].block
        )
    }
    return {param: s for param, s in candidates.items() if param not in misaligned}


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
    scheme: WeightScheme,
) -> CheckpointError:
    rows, cols = src
    size = (rows[1] - rows[0], cols[1] - cols[0])
    bn, bk = scheme.block
    return CheckpointError(
        f"tensor {info.raw!r} {info.shape} in {info.file} loads as {scheme.label} in {bn}x{bk} blocks, "
        f"but this rank's shard of it (rows {rows[0]}:{rows[1]}, columns {cols[0]}:{cols[1]}: shard size "
        f"{size}) goes to rows {dest[0][0]}:{dest[0][1]}, columns {dest[1][0]}:{dest[1][1]} of parameter "
        f"{param!r} {param_shape}, not on {bn}x{bk} block boundaries of both: kept {scheme.label}, the "
        "blocks it shares would be cut. Use a tensor-parallel size whose shards are multiples of the block, or "
        "--quantization none (weights in --dtype: the checkpoint dequantized at load)"
    )


@dataclass(frozen=True)
class QuantizedRead:
    """The blocks one shard of a quantized tensor touches: ``values`` (as stored) with their ``scales``; the shard
    starts ``offset`` (rows, columns: logical elements) into them and spans ``size``."""

    values: torch.Tensor
    scales: torch.Tensor
    offset: tuple[int, int]
    size: tuple[int, int]


def read_quantized(
    tensor, info: TensorInfo, quantized: QuantizedTensor, source: tuple
) -> QuantizedRead:
    """``tensor[source]`` (a safetensors slice; ``source`` and ``info.shape`` in logical elements) with the blocks
    it touches: read as they are with their scales, or, when the scales are None, quantized now over the blocks of
    the whole tensor."""
    scheme = quantized.scheme
    index = _full_index(source, info.shape)
    spans = _spans(index, info.shape)
    blocks = _block_slices(spans, scheme.block)
    region = tuple(
        slice(b.start * size, min(b.stop * size, n))
        for b, size, n in zip(blocks, scheme.block, info.shape[-2:])
    )
    lead = index[:-2]
    if quantized.scales is None:
        values, scales = scheme.quantize(tensor[lead + region])
    else:
        rows, cols = region
        stored_cols = slice(cols.start // scheme.pack, cols.stop // scheme.pack)
        values, scales = tensor[lead + (rows, stored_cols)], quantized.scales[lead + blocks]
    offset = tuple(start - r.start for (start, _), r in zip(spans, region))
    return QuantizedRead(values, scales, offset, tuple(stop - start for start, stop in spans))


def load_quantized(
    read: QuantizedRead, shard: Shard, params: dict, quantized: QuantizedTensor
) -> None:
    """One shard into its parameter: dequantized (exactly) into a high-precision one, or copied with its scales
    into a quantized one (``check_alignment`` made sure its blocks are the parameter's)."""
    scheme = quantized.scheme
    param = params[shard.param]
    if not _is_kept(param):
        rows = slice(read.offset[0], read.offset[0] + read.size[0])
        cols = slice(read.offset[1], read.offset[1] + read.size[1])
        dequantized = scheme.dequantize(read.values, read.scales, torch.float32)
        param.data[shard.index].copy_(dequantized[..., rows, cols])
        return
    values, scales = scheme.to_stored(read.values, read.scales, param.dtype)
    logical = scheme.logical_shape(tuple(param.shape))
    index = _full_index(shard.index, logical)
    rows, cols = _spans(index, logical)
    stored = (slice(*rows), slice(cols[0] // scheme.pack, cols[1] // scheme.pack))
    param.data[index[:-2] + stored].copy_(values)
    blocks = _block_slices([rows, cols], scheme.block)
    params[shard.param + scheme.scale_suffix].data[index[:-2] + blocks].copy_(scales)


def _is_kept(param: torch.Tensor) -> bool:
    """A parameter holding quantized values (FP8 or packed uint8), not high-precision ones."""
    return param.element_size() == 1


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
