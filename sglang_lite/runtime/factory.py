"""Builds what a scheduler process runs: one scheduler (one DP rank) with its model, pools, limits and tokenizer."""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from sglang_lite.config import ModelConfig
from sglang_lite.distributed import get_parallel_state
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.mem_cache.request_memory import RequestMemory
from sglang_lite.model_executor import ModelRunner
from sglang_lite.models.loader import load_model
from sglang_lite.pd_transport.layout import PoolShard
from sglang_lite.pd_transport.transfer import MooncakeTransfer, local_hostname
from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.runtime.memory import (
    resolve_dtype,
    resolve_max_total_tokens,
    resolve_quantized_weights,
    resolve_state_snapshots,
    resolve_weight_dtype,
)
from sglang_lite.sampling.grammar import reasoning_end_ids
from sglang_lite.scheduler.pd_side import AttentionGroup, DisaggSide, NullSide, create_side
from sglang_lite.scheduler.scheduler import Scheduler, create_request_memory
from sglang_lite.server_args import ServerArgs
from sglang_lite.tokenizer.hf_tokenizer import load_server_tokenizer
from sglang_lite.utils import speculative_flags


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
    """One rank's scheduler. The model reads the server arguments itself, through ``get_global_server_args()``
    (the upstream contract: the rank process sets them once, model code reads them lazily)."""
    dtype = resolve_dtype(args)
    quantized_weights, misaligned = resolve_quantized_weights(args)
    model = load_model(
        args.model_dir,
        dtype=dtype,
        device=args.device,
        load_format=args.load_format,
        seed=args.random_seed,
        weight_dtype=resolve_weight_dtype(args, dtype),
        quantized_weights=quantized_weights,
        misaligned=misaligned,
        with_mtp=speculative_flags.uses_mtp_head(args),
        with_vision=True,
    )
    context_length = args.context_length or model.config.max_position_embeddings
    max_total_tokens = resolve_max_total_tokens(args, model.config, dtype, context_length)
    eos = eos_token_ids(args.model_dir, model.config.eos_token_ids)
    tokenizer = load_server_tokenizer(args)
    think_end = reasoning_end_ids(tokenizer, args.reasoning_parser)
    config = SchedulerConfig.from_server_args(args, model.config, max_total_tokens, eos, think_end)
    config = dataclasses.replace(config, dp_rank=dp_rank)
    pools = ModelPools.create(
        model.config,
        max_total_tokens,
        args.max_running_requests,
        context_length,
        dtype,
        args.device,
        resolve_state_snapshots(args, model.config, dtype, max_total_tokens),
        page_size=args.page_size,
        draft_layers=1 if speculative_flags.uses_mtp_head(args) else 0,
    )
    memory = create_request_memory(pools)
    return Scheduler(
        config,
        ModelRunner(model, pools, args),
        pools,
        tokenizer,
        _pd_side(args, memory, model.config, dtype),
        memory,
    )


def _pd_side(
    args: ServerArgs, memory: RequestMemory, config: ModelConfig, dtype: torch.dtype
) -> DisaggSide:
    """This rank's side of PD disaggregation, with its transfer engine and the heads its pools hold (a null side
    when it serves whole requests)."""
    if args.disaggregation_mode == "null":
        return NullSide()
    # a CPU server's cores run the forwards: a write polls rather than spin a core (MooncakeTransfer.write); a
    # write's deadline is half the transfer timeout, so that a failed one settles within it (pd_side/decode_side.py)
    transfer = MooncakeTransfer.start(
        local_hostname(args.host),
        args.disaggregation_ib_device,
        poll=args.device == "cpu",
        write_timeout_s=args.disaggregation_transfer_timeout / 2,
    )
    state = get_parallel_state()
    group = AttentionGroup(state.attn_tp_rank, state.attn_tp_size, state.cpu_attn)
    shard = PoolShard.of(config, state.attn_tp_rank, state.attn_tp_size, dtype)
    return create_side(
        args.disaggregation_mode,
        transfer,
        memory,
        args.disaggregation_transfer_timeout,
        group,
        shard,
    )
