"""What the server says about itself and its model: ``/server_info``, ``/model_info`` and the served model name."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from sglang_lite.config import ModelConfig, quantization_config_in_use, quantization_in_use
from sglang_lite.runtime.memory import resolve_quantized_weights
from sglang_lite.server.model_name import served_model_name
from sglang_lite.server.tokenizer_manager import TokenizerManager
from sglang_lite.server_args import ServerArgs

VERSION = "sglang_lite-0.1.0"


def server_info_of(manager: TokenizerManager, args: ServerArgs) -> dict[str, Any]:
    info = {k: v for k, v in dataclasses.asdict(args).items() if k != "api_key"}
    config = manager.config
    info.update(
        version=VERSION,
        dp_size=args.dp_size,
        model_path=args.model_dir,
        served_model_name=served_model_name(args),
        context_length=config.context_length,
        max_total_num_tokens=config.max_total_tokens,
        max_running_requests=config.max_running_requests,
        is_generation=True,
        scheduler_pids=manager.rank_pids,
    )
    if manager.alt_stream_plan is not None:
        info["alt_stream_plan"] = manager.alt_stream_plan
    info.update(quantization_of(args))
    return info


def quantization_of(args: ServerArgs) -> dict[str, str]:
    """``quantization``: the weight format the model runs (``fp8``, ``mxfp4``, ``none``), and, when quantized,
    ``quantization_config``: the config in words and where the weights are kept."""
    model_config = ModelConfig.from_hf(args.model_dir)
    name = quantization_in_use(model_config, args.quantization)
    if name == "none":
        return {"quantization": name}
    keep, _ = resolve_quantized_weights(args)
    kept = keep if keep is not None else args.device.startswith("cuda")
    where = f"kept {name} in memory" if kept else "dequantized at load"
    config = quantization_config_in_use(model_config, args.quantization)
    return {"quantization": name, "quantization_config": f"{config.describe()}; weights {where}"}


def model_info_of(manager: TokenizerManager, args: ServerArgs) -> dict[str, Any]:
    with open(os.path.join(args.model_dir, "config.json")) as f:
        hf_config = json.load(f)
    return {
        "model_path": args.model_dir,
        "tokenizer_path": args.tokenizer_dir,
        "served_model_name": served_model_name(args),
        "is_generation": True,
        "model_type": hf_config.get("model_type"),
        "architectures": hf_config.get("architectures"),
        "context_length": manager.config.context_length,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": bool(manager.config.image_merge_size),
        "has_audio_understanding": False,
    }
