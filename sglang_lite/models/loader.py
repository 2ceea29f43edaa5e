"""``load_model``: the right Qwen3.5 class for a checkpoint's config, with real or seeded dummy weights."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from collections.abc import Iterator

import torch
from torch import nn

from sglang_lite import assets
from sglang_lite.config import ModelConfig, quantization_config_in_use
from sglang_lite.layers.mlp import Qwen3_5SparseMoeBlock
from sglang_lite.layers.vocab import VocabParallelEmbedding
from sglang_lite.models.qwen3_5 import Qwen3_5ForCausalLM, model_class_for
from sglang_lite.models.qwen3_5_vision import Qwen3_5VisionModel, VisionConfig, load_vision_weights
from sglang_lite.models.weights import load_checkpoint, quantize_dummy_weights
from sglang_lite.server_args import LOAD_FORMATS, QUANTIZATIONS, ServerArgs, server_args_or_default

logger = logging.getLogger(__name__)

MISALIGNED = ("error", "dequantize")


def load_model(
    path: str | os.PathLike | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    load_format: str = "auto",
    seed: int = 0,
    server_args: ServerArgs | None = None,
    quantization: str | None = None,
    quantized_weights: bool | None = None,
    weight_dtype: torch.dtype | None = None,
    misaligned: str = "error",
    with_mtp: bool = False,
    with_vision: bool = False,
) -> Qwen3_5ForCausalLM:
    """Builds the model described by ``path/config.json`` (None: the built-in tiny model, trained on the Python
    standard library by scripts/train_tiny_model.py).

    ``load_format="auto"`` reads safetensors from ``path``; ``"dummy"`` fills seeded random weights (quantized
    ones kept quantized as ``quantization`` says, for benchmarks).
    ``server_args`` (default: the global ones, else defaults) decide shared-expert fusion and the stream plan.
    ``quantization`` (default: the server arguments', else what the checkpoint's quantization_config says; see
    ``sglang_lite/quantization``): ``"fp8"`` runs a block-FP8 checkpoint as it is, or quantizes a high-precision
    one at load (online FP8: 128x128 e4m3 blocks, as the FP8 checkpoints); ``"mxfp4"`` (or ``"quark"``) runs an
    AMD Quark MXFP4 checkpoint, or quantizes a high-precision one's experts and full-attention projections at
    load; ``"none"`` dequantizes a quantized checkpoint into ``dtype`` at load. ``quantized_weights``: keep the
    quantized projections in their format (default: on a GPU; on the CPU they are dequantized, exactly, into
    ``dtype``). A kept projection's shards must cover whole blocks of the parameter (``misaligned="error"``: a
    ``CheckpointError`` otherwise), or, with ``"dequantize"``, the projections that do not are dequantized instead.
    ``weight_dtype``: the projections' weights (linear layers, experts, embedding, LM head) in this dtype while
    activations, norms and states stay in ``dtype`` (the CPU keeps a bf16 checkpoint's weights bf16 this way: its
    C++ kernels widen them in registers).
    ``with_mtp``: also load the checkpoint's multi-token-prediction head (``mtp.*``, checked as the rest) as
    ``model.mtp``, the draft model of speculative decoding; by default it is skipped.
    ``with_vision``: also load a VL checkpoint's vision tower (``model.visual``, float32 on ``device``), for image
    input; by default (and for a text-only checkpoint) there is none.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    path = assets.model_dir(path)
    args = server_args if server_args is not None else server_args_or_default()
    config = ModelConfig.from_hf(path)
    quantization = quantization or args.quantization
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if misaligned not in MISALIGNED:
        raise ValueError(f"misaligned must be one of {MISALIGNED}, got {misaligned!r}")
    if quantization != args.quantization:
        # the model decides shared-expert fusion by the quantization in use (MXFP4 does not fuse)
        server_args = dataclasses.replace(args, quantization=quantization)
    model = create_model(config, dtype, device, server_args, weight_dtype, with_mtp)
    quant = quantization_config_in_use(config, quantization)
    on_gpu = torch.device(device).type == "cuda"
    keep = quant is not None and (on_gpu if quantized_weights is None else quantized_weights)
    if quant is not None and quant.quantizes_activations:
        keep, misaligned = _keep_for_activations(quantized_weights), "error"
    if load_format == "dummy":
        init_dummy_weights(model, seed)
        if keep:
            quantize_dummy_weights(model, quant, device)
        if with_vision:
            attach_vision(model, None, device)
        return model.eval()
    shown = quant or config.quantization
    if shown is not None:
        where = (
            "kept quantized in memory" if keep else f"dequantized to {model.lm_head.weight.dtype}"
        )
        logger.info(
            "quantization: %s; %s; quantized weights %s",
            quantization or "auto",
            shown.describe() if shown.online else f"checkpoint {shown.describe()}",
            where,
        )
    load_checkpoint(
        model,
        path,
        config.tie_word_embeddings,
        # "none" still checks a quantized checkpoint's scales against its config
        config.quantization or quant,
        device if keep else None,
        misaligned == "dequantize",
        with_mtp,
    )
    if with_vision:
        attach_vision(model, path, device)
    return model.eval()


def attach_vision(model: Qwen3_5ForCausalLM, path: str | None, device: torch.device | str) -> None:
    """The checkpoint's vision tower as ``model.visual``, its weights read from ``path`` (None: left as
    initialised, for dummy weights); nothing for a text-only checkpoint. Attached after the text weights are
    loaded, whose checks know nothing of it."""
    if model.config.vision is None:
        return
    vision = VisionConfig.from_dict(model.config.vision.vision_config)
    with torch.device(device):
        visual = Qwen3_5VisionModel(vision)
    if path is not None:
        load_vision_weights(visual, path)
    model.visual = visual.eval()


def _keep_for_activations(quantized_weights: bool | None) -> bool:
    """W4A4 weights stay in their layers, which round the activations; dequantized, they would not."""
    if quantized_weights is False:
        raise ValueError(
            "the checkpoint quantizes activations (quantization_config input_tensors: W4A4), which its "
            "quantized layers do: quantized_weights=False would dequantize them and skip that; use "
            "--quantization none to run the dequantized weights without activation quantization"
        )
    return True


def create_model(
    config: ModelConfig,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    server_args: ServerArgs | None = None,
    weight_dtype: torch.dtype | None = None,
    with_mtp: bool = False,
) -> Qwen3_5ForCausalLM:
    """The model class for ``config`` (with its MTP head when ``with_mtp``), built on ``device`` in
    ``dtype`` (A_log kept fp32), the projections' weights
    in ``weight_dtype`` when given, weights uninitialised."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with _default_dtype(dtype), torch.device(device):
        model = model_class_for(config)(config, server_args, with_mtp)
    _keep_fp32(model)
    if weight_dtype is not None and weight_dtype != dtype:
        for weight in projection_weights(model):
            weight.data = weight.data.to(weight_dtype)
    return model


def projection_weights(model: nn.Module) -> list[nn.Parameter]:
    """The weights the projections multiply by: every linear layer's, the embedding's and LM head's (one parameter
    when tied), each MoE block's experts ``w13`` and ``w2``. Not the norms, conv1d and the GDN's decay rates, nor
    the MoE routers (``gate``, ``shared_expert_gate``: a few KB a layer whose float32 product keeps each token's
    choice of experts as the float32 model makes it)."""
    routers = set()
    found: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, Qwen3_5SparseMoeBlock):
            routers.update((id(module.gate.weight), id(module.shared_expert_gate.weight)))
            found.setdefault(id(module.experts.w13), module.experts.w13)
            found.setdefault(id(module.experts.w2), module.experts.w2)
        if isinstance(module, (nn.Linear, VocabParallelEmbedding)):
            found.setdefault(id(module.weight), module.weight)
    return [weight for key, weight in found.items() if key not in routers]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _keep_fp32(model: nn.Module) -> None:
    for module in model.modules():
        for name in getattr(module, "fp32_params", ()):
            getattr(module, name).data = getattr(module, name).data.float()


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Seeded random weights: small values everywhere (Gemma norms scale by 1 + w), real decay rates for GDN."""
    # generated where the weights live, so a large dummy model on a GPU does not wait for the CPU
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        _fill_dummy(name, param, gen)


def _fill_dummy(name: str, param: torch.Tensor, gen: torch.Generator) -> None:
    if name.endswith("A_log"):
        param.uniform_(math.log(1.0), math.log(16.0), generator=gen)
    elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
        param.fill_(1.0)
    else:
        param.normal_(0.0, 0.02, generator=gen)
