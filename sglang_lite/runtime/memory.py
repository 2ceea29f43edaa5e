"""Sizing: the compute dtype, the weights' formats, and how many KV tokens fit the memory budget."""

from __future__ import annotations

import json
import logging
import os

import torch

from sglang_lite.config import ModelConfig
from sglang_lite.kernels import cpu as cpu_kernels
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.server_args import ServerArgs
from sglang_lite.utils import speculative_flags

logger = logging.getLogger(__name__)

MIB = 2**20
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(args: ServerArgs) -> torch.dtype:
    """auto: the checkpoint's float dtype on GPU; float32 on CPU, where half precision is slow. On the CPU with its
    C++ kernels the activations are float32 at bfloat16 too (the dtype of the weights there: ``resolve_weight_dtype``;
    bf16 activations would run the PyTorch references, slower, and not batch invariant) and under deterministic
    inference whatever the dtype (its batch-invariant kernels are the C++ ones)."""
    if _cpu_kernels(args) and (
        args.dtype in ("auto", "bfloat16") or args.enable_deterministic_inference
    ):
        if args.dtype not in ("auto", "float32"):
            logger.info("CPU: float32 activations, %s weights", args.dtype)
        return torch.float32
    if args.dtype != "auto":
        return FLOAT_DTYPES[args.dtype]
    if not args.device.startswith("cuda"):
        return torch.float32
    return FLOAT_DTYPES.get(_checkpoint_dtype(args.model_dir), torch.bfloat16)


def resolve_weight_dtype(args: ServerArgs, dtype: torch.dtype) -> torch.dtype:
    """The projections' weights: in the compute dtype, except on the CPU with its C++ kernels at ``--dtype
    bfloat16`` (bf16), and at ``--dtype auto``, where a bf16 checkpoint's stay bf16: they widen each weight in
    registers (float32 activations and accumulation), and a decode step, which waits on reading the weights, reads
    half the bytes."""
    if _cpu_kernels(args) and args.dtype == "bfloat16":
        return torch.bfloat16
    if args.dtype != "auto" or args.device.startswith("cuda") or dtype != torch.float32:
        return dtype
    if _checkpoint_dtype(args.model_dir) != "bfloat16" or not cpu_kernels.enabled():
        return dtype
    logger.info(
        "CPU: the checkpoint's bf16 weights stay bf16 (the C++ kernels read them); activations float32"
    )
    return torch.bfloat16


def _cpu_kernels(args: ServerArgs) -> bool:
    """The run is on the CPU and takes its C++ kernels."""
    return not args.device.startswith("cuda") and cpu_kernels.enabled()


def resolve_quantized_weights(args: ServerArgs) -> tuple[bool | None, str]:
    """``load_model``'s ``quantized_weights`` and ``misaligned``: a GPU keeps quantized projections in their format
    (a shard that cuts a block is refused); the CPU keeps those whose blocks align when its C++ kernels build (they
    dequantize FP8 and MXFP4 weights in registers) and dequantizes the others at load."""
    if not _cpu_kernels(args):
        return None, "error"
    return True, "dequantize"


def _checkpoint_dtype(model_dir: str) -> str | None:
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    text = raw.get("text_config") or {}
    return (
        raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    )


def device_budget_bytes(device: str, fraction: float) -> int:
    """Bytes the pools may take: ``fraction`` of device memory minus what is already used (weights included)."""
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(device))
        return int(total * fraction - (total - free))
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_AVPHYS_PAGES"
    )  # weights are already loaded
    return int(available * fraction)


def resolve_max_total_tokens(
    args: ServerArgs, config: ModelConfig, dtype: torch.dtype, context_length: int
) -> int:
    """Explicit ``max_total_tokens``, else what the budget holds after the fixed state slots
    (``fixed_state_slots``) and, with the prefix cache and no ``max_mamba_cache_size``, the
    snapshot pool's share (``mamba_full_memory_ratio`` of the KV pool's memory), capped at what
    could be used: every request row filled to the context length, and with the prefix cache as
    much again for cached prefixes. Rounded up to whole pages."""
    size = args.page_size
    if args.max_total_tokens is not None:
        return -(-args.max_total_tokens // size) * size
    budget = device_budget_bytes(args.device, args.mem_fraction_static)
    states_bytes = fixed_state_slots(args) * ModelPools.bytes_per_request_state(config, dtype)
    # the MTP head's KV sits in the same slots (speculation)
    draft_layers = 1 if speculative_flags.uses_mtp_head(args) else 0
    per_token = max(ModelPools.bytes_per_token(config, dtype, draft_layers), 1)
    rows = args.max_running_requests
    if args.prefix_cache:
        rows *= 2
    if args.prefix_cache and args.max_mamba_cache_size is None:
        per_token *= 1 + args.mamba_full_memory_ratio  # the snapshots' share grows with the pool
    fits = max(budget - states_bytes, 0) // per_token
    tokens = min(fits, rows * context_length)
    if tokens < context_length:
        raise MemoryError(_too_small(args, tokens, context_length, budget, states_bytes))
    return -(-int(tokens) // size) * size


def fixed_state_slots(args: ServerArgs) -> int:
    """GDN state slots whose number does not follow the KV pool: the running requests', with
    speculation the states a verify forward keeps (``VerifyStates``, k + 1 a request, static
    under CUDA graphs), and the snapshot slots an explicit ``max_mamba_cache_size`` asks for."""
    running = args.max_running_requests
    verify = running * (args.speculative_steps + 1) if args.speculative_steps else 0
    return running + verify + _fixed_snapshots(args)


def _fixed_snapshots(args: ServerArgs) -> int:
    """Snapshot slots of an explicit ``max_mamba_cache_size`` (its slots less the running
    requests'); 0 when it is unset or the prefix cache is off."""
    if not args.prefix_cache or args.max_mamba_cache_size is None:
        return 0
    return args.max_mamba_cache_size - args.max_running_requests


def _too_small(
    args: ServerArgs, tokens: int, context_length: int, budget: int, states_bytes: int
) -> str:
    pool = f"the KV pool would hold only {tokens} tokens, less than the context length {context_length}"
    if args.max_mamba_cache_size is None or not args.prefix_cache:
        return (
            f"{pool}; raise mem_fraction_static, lower max_running_requests or context_length, or set "
            "max_total_tokens"
        )
    slots = f"--max-mamba-cache-size {args.max_mamba_cache_size}"
    taken = f"{states_bytes / MIB:.1f} MiB of the budget's {max(budget, 0) / MIB:.1f} MiB"
    return (
        f"{pool}: the state slots of {slots} (the running requests' included) take {taken} "
        f"(--mem-fraction-static {args.mem_fraction_static}); lower --max-mamba-cache-size, raise "
        "--mem-fraction-static, or set --max-total-tokens"
    )


def resolve_state_snapshots(
    args: ServerArgs, config: ModelConfig, dtype: torch.dtype, max_total_tokens: int
) -> int:
    """State slots for the prefix cache's GDN snapshots (0 without the cache): ``max_mamba_cache_size`` less the
    running requests' slots, else ``mamba_full_memory_ratio`` of the KV pool's memory, at least one per running
    request."""
    if not args.prefix_cache:
        return 0
    if args.max_mamba_cache_size is not None:
        return _fixed_snapshots(args)
    kv_bytes = max_total_tokens * ModelPools.bytes_per_token(config, dtype)
    per_slot = max(ModelPools.bytes_per_request_state(config, dtype), 1)
    from_memory = int(args.mamba_full_memory_ratio * kv_bytes) // per_slot
    return max(from_memory - args.max_running_requests, args.max_running_requests)
