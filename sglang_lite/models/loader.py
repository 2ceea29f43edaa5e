"""``load_model``: the right Qwen3.5 class for a checkpoint's config, with real or seeded dummy weights."""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator

import torch
from torch import nn

from sglang_lite import assets
from sglang_lite.config import ModelConfig, quantization_config_in_use
from sglang_lite.kernels import fp8_dtype
from sglang_lite.models.qwen3_5 import Qwen3_5ForCausalLM, model_class_for
from sglang_lite.models.weights import load_checkpoint
from sglang_lite.server_args import LOAD_FORMATS, QUANTIZATIONS, ServerArgs, server_args_or_default

logger = logging.getLogger(__name__)


def load_model(
    path: str | os.PathLike | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    load_format: str = "auto",
    seed: int = 0,
    server_args: ServerArgs | None = None,
    quantization: str | None = None,
    fp8_weights: bool | None = None,
) -> Qwen3_5ForCausalLM:
    """Builds the model described by ``path/config.json`` (None: the built-in tiny model, trained on the Python
    standard library by scripts/train_tiny_model.py).

    ``load_format="auto"`` reads safetensors from ``path``; ``"dummy"`` fills seeded random weights.
    ``server_args`` (default: the global ones, else defaults) decide shared-expert fusion and the stream plan.
    ``quantization`` (default: the server arguments', else what the checkpoint says): ``"fp8"`` runs a block-FP8
    checkpoint as it is, or quantizes a high-precision one at load (online FP8: 128x128 e4m3 blocks, as the FP8
    checkpoints); ``"none"`` dequantizes an FP8 checkpoint into ``dtype`` at load. ``fp8_weights``: keep the
    quantized projections in FP8 (default: on a GPU; on the CPU they are dequantized, exactly, into ``dtype``).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    path = assets.model_dir(path)
    args = server_args if server_args is not None else server_args_or_default()
    config = ModelConfig.from_hf(path)
    quantization = quantization or args.quantization
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    model = create_model(config, dtype, device, server_args)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
        return model.eval()
    quant = quantization_config_in_use(config, quantization)
    on_gpu = torch.device(device).type == "cuda"
    keep_fp8 = quant is not None and (on_gpu if fp8_weights is None else fp8_weights)
    shown = quant or config.quantization
    if shown is not None:
        where = (
            f"FP8 in memory ({fp8_dtype(device)})"
            if keep_fp8
            else f"dequantized to {model.lm_head.weight.dtype}"
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
        # "none" still checks an FP8 checkpoint's scales against its config
        config.quantization or quant,
        fp8_dtype(device) if keep_fp8 else None,
    )
    return model.eval()


def create_model(
    config: ModelConfig,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    server_args: ServerArgs | None = None,
) -> Qwen3_5ForCausalLM:
    """The model class for ``config``, built on ``device`` in ``dtype`` (A_log kept fp32), weights uninitialised."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with _default_dtype(dtype), torch.device(device):
        model = model_class_for(config)(config, server_args)
    _keep_fp32(model)
    return model


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
