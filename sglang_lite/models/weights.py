"""Reading Hugging Face safetensors checkpoints into the model's (packed) parameters.

Names are normalised first (``model.language_model.`` -> ``model.``; vision tower and MTP head skipped), then
matched one to one against the checkpoint names the model expects, which each layer declares through
``packed_shards`` (an MoE block declares its experts apart, in either checkpoint layout: ``per_expert_shards``,
``fused_expert_shards``). Everything is checked from the files' headers (``checkpoint.py``, each read once) before
any data is: anything missing, unexpected or mis-shaped raises ``CheckpointError`` naming the tensor. Then each
file is opened once and a tensor-parallel rank reads only its slices of each tensor (``safe_open.get_slice``), and
nothing of another rank's experts.

Quantized weights (``quant_loading.py``): the checkpoint's quantized tensors (their scales beside them, checked
against the scheme the quantization config gives the module) or, for online quantization, the high-precision tensors
a quantized layer can hold; each shard is dequantized into the compute dtype or, into a parameter kept quantized
(``layers/quant.py``), copied with its scales.
"""

from __future__ import annotations

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from sglang_lite.layers.linear import Shard, ShardMap
from sglang_lite.layers.quant import convert, quantizable_parameters
from sglang_lite.models import quant_loading
from sglang_lite.models.checkpoint import CheckpointError, TensorInfo, checkpoint_tensors
from sglang_lite.quantization import QuantizationConfig

SKIPPED_PREFIXES = ("model.visual.", "visual.")
# where checkpoints keep the MTP head: at the top level, or (some VL exports) under the language model
MTP_PREFIXES = ("mtp.", "model.language_model.mtp.", "model.mtp.")

__all__ = ["CheckpointError", "expected_targets", "load_checkpoint", "normalise_name"]


def normalise_name(name: str, with_mtp: bool = False) -> str | None:
    """The model's name for a checkpoint tensor, or None for tensors text-only serving skips (the MTP head's
    unless ``with_mtp``: then they are ``mtp.*``, wherever the checkpoint keeps them)."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    for prefix in MTP_PREFIXES:
        if name.startswith(prefix):
            return "mtp." + name[len(prefix) :] if with_mtp else None
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
    quant: QuantizationConfig | None = None,
    keep_quantized: torch.device | str | None = None,
    dequantize_misaligned: bool = False,
    with_mtp: bool = False,
) -> None:
    """Fills ``model`` from the checkpoint at ``path`` (its MTP head too with ``with_mtp``).
    ``quant``: the checkpoint's quantization config (its quantized tensors are checked against it), or an
    ``online`` one (``quantization.ONLINE``: quantize the high-precision checkpoint at load);
    ``keep_quantized``: keep the quantized projections in their scheme's storage for this device (None:
    dequantize them into the model's dtype); ``dequantize_misaligned``: dequantize those whose shards do not
    cover whole blocks of the parameter instead of refusing them."""
    online = quant is not None and quant.online
    files = _model_tensors(path, tied_lm_head, with_mtp)
    fused = any(name.endswith("mlp.experts.gate_up_proj") for name in files)
    targets = expected_targets(model, fused)
    quant_loading.skip_unused_scales(files, targets)
    # a scale without a quantization_config is refused, online quantization or not
    quantized = quant_loading.take_scales(files, None if online else quant)
    params = dict(model.named_parameters())
    _check_names(files, targets, params, path)
    if online:
        quantized = quant_loading.online_quantized(
            files, targets, quantizable_parameters(model), quant
        )
    quant_loading.check_has_scales(files, quantized)
    _check_shapes(files, targets, params)
    if quantized and keep_quantized is not None:
        kept = quant_loading.kept_parameters(files, targets, quantized)
        if dequantize_misaligned:
            kept = quant_loading.aligned_parameters(files, targets, params, kept)
        convert(model, kept, keep_quantized)
        params = dict(model.named_parameters())
        quant_loading.check_alignment(files, targets, params, kept)
    by_file: dict[str, list[str]] = {}
    for name, info in files.items():
        by_file.setdefault(info.file, []).append(name)
    with tqdm(
        total=len(files), desc="Loading weights", unit="tensor", disable=len(files) < 200
    ) as bar:
        for file, names in by_file.items():
            _load_file(file, names, files, targets, params, quantized)
            bar.update(len(names))


def _model_tensors(path: str, tied_lm_head: bool, with_mtp: bool) -> dict[str, TensorInfo]:
    """The checkpoint's tensors by the model's names, without those text-only serving skips."""
    files = {}
    for raw, info in checkpoint_tensors(path).items():
        name = normalise_name(raw, with_mtp)
        if name is not None:
            files[name] = info
    if tied_lm_head:
        files.pop("lm_head.weight", None)  # a tied head is the embedding; a saved copy is redundant
    return files


def _check_names(
    files: dict[str, TensorInfo], targets: dict[str, list[Shard]], params: dict, path: str
) -> None:
    unexpected = sorted(set(files) - set(targets))
    if unexpected:
        info = files[unexpected[0]]
        raise CheckpointError(
            f"unexpected tensor {info.raw!r} (shape {info.shape}) in {info.file}: the model expects no "
            f"such weight ({len(unexpected)} unexpected in all)"
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


def _check_shapes(
    files: dict[str, TensorInfo], targets: dict[str, list[Shard]], params: dict
) -> None:
    """Each shard of each tensor has its parameter part's shape (from the header: nothing is read)."""
    for name, info in files.items():
        for shard in targets[name]:
            expected = tuple(params[shard.param].data[shard.index].shape)
            found = _sliced_shape(info.shape, shard.source)
            if found != expected:
                what = (
                    f" (this rank's slice {_describe(shard.source)} of {info.shape})"
                    if shard.source
                    else ""
                )
                raise CheckpointError(
                    f"shape mismatch for tensor {info.raw!r} in {info.file}: expected {expected}, "
                    f"found {found}{what}"
                )


def _load_file(
    file: str,
    names: list[str],
    files: dict[str, TensorInfo],
    targets: dict[str, list[Shard]],
    params: dict,
    quantized: quant_loading.Quantized,
) -> None:
    with safe_open(file, "pt") as f:
        for name in names:
            info = files[name]
            tensor = f.get_slice(info.raw)
            for shard in targets[name]:
                if name in quantized:
                    read = quant_loading.read_quantized(tensor, info, quantized[name], shard.source)
                    quant_loading.load_quantized(read, shard, params, quantized[name])
                else:
                    dest = params[shard.param].data[shard.index]
                    dest.copy_(tensor[shard.source] if shard.source else f.get_tensor(info.raw))


def _sliced_shape(shape: tuple[int, ...], source: tuple) -> tuple[int, ...]:
    """The shape of ``tensor[source]`` for a tensor of ``shape``, without reading it (an overrun is visible: a
    slice past the end shortens the result, as indexing does)."""
    out = [len(range(*s.indices(n))) for s, n in zip(source, shape)]
    return (*out, *shape[len(source) :])


def _describe(source: tuple) -> str:
    return "[" + ", ".join(":" if s == slice(None) else f"{s.start}:{s.stop}" for s in source) + "]"


@torch.no_grad()
def quantize_dummy_weights(
    model: nn.Module, quant: QuantizationConfig, device: torch.device | str
) -> None:
    """Keeps ``model``'s dummy (random) weights quantized as a checkpoint of ``quant`` would hold them: each
    parameter whose every checkpoint tensor the config quantizes, in that scheme, quantized from its values (for
    benchmarks of quantized layers without a checkpoint)."""
    targets = expected_targets(model, fused_experts=False)
    capable = quantizable_parameters(model)
    schemes: dict[str, set] = {}
    for name, shards in targets.items():
        scheme = quant.scheme_for(name.removesuffix(".weight"))
        for shard in shards:
            schemes.setdefault(shard.param, set()).add(scheme)
    kept = {
        param: found.pop()
        for param, found in schemes.items()
        if param in capable and len(found) == 1 and None not in found
    }
    params = dict(model.named_parameters())
    values = {param: params[param].data.float() for param in kept}
    convert(model, kept, device)
    params = dict(model.named_parameters())
    for param, scheme in kept.items():
        stored, scales = scheme.quantize(values[param])
        stored, scales = scheme.to_stored(stored, scales, params[param].dtype)
        params[param].data.copy_(stored)
        params[param + scheme.scale_suffix].data.copy_(scales)
