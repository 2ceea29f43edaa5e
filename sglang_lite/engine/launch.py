"""Builds one scheduler (one DP rank) from server arguments: model, tokenizer, pools, limits."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.model_executor import ModelRunner
from sglang_lite.scheduler.config import SchedulerConfig
from sglang_lite.scheduler.scheduler import Scheduler
from sglang_lite.server_args import ServerArgs
from sglang_lite.tokenizer.loader import TINY_MODEL_DIR, load_tokenizer
from sglang_lite.engine.memory import resolve_dtype, resolve_max_total_tokens


def model_dir_of(args: ServerArgs) -> str:
    return args.model_path or str(TINY_MODEL_DIR)


def load_server_tokenizer(args: ServerArgs) -> Any:
    """The tokenizer the arguments name (the model's own by default), or None with ``skip_tokenizer_init``."""
    return None if args.skip_tokenizer_init else load_tokenizer(args.tokenizer_path or model_dir_of(args))


def eos_token_ids(model_dir: str, config_eos: tuple[int, ...]) -> tuple[int, ...]:
    """The model config's eos ids plus generation_config.json's, as transformers ``generate`` stops on both."""
    ids = list(config_eos)
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(path):
        with open(path) as f:
            extra = json.load(f).get("eos_token_id")
        ids += extra if isinstance(extra, list) else [] if extra is None else [extra]
    return tuple(dict.fromkeys(int(i) for i in ids))


def create_scheduler(args: ServerArgs, dp_rank: int = 0) -> Scheduler:
    from sglang_lite.models.loader import load_model

    model_dir = model_dir_of(args)
    dtype = resolve_dtype(args, model_dir)
    model = load_model(args.model_path, dtype=dtype, device=args.device, load_format=args.load_format,
                       seed=args.random_seed, server_args=args)
    tokenizer = load_server_tokenizer(args)
    context_length = args.context_length or model.config.max_position_embeddings
    max_total_tokens = resolve_max_total_tokens(args, model.config, dtype, context_length)
    config = SchedulerConfig.from_server_args(args, model.config, max_total_tokens, eos_token_ids(model_dir, model.config.eos_token_ids))
    config = dataclasses.replace(config, dp_rank=dp_rank)
    pools = ModelPools.create(model.config, max_total_tokens, args.max_running_requests, context_length, dtype, args.device)
    return Scheduler(config, ModelRunner(model, pools, args), pools, tokenizer)
