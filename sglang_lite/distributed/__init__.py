"""Tensor, expert and DP-attention parallelism on torch.distributed: the process groups and the collectives."""

from sglang_lite.distributed.comm import (
    CollectiveError,
    DPTokens,
    all_gather_objects,
    any_rank,
    any_ranks,
    attn_all_gather,
    attn_all_reduce,
    broadcast_object,
    gather_objects,
    world_all_reduce,
)
from sglang_lite.distributed.parallel_state import (
    ParallelConfig,
    ParallelState,
    destroy_distributed,
    get_parallel_state,
    init_distributed,
)

__all__ = [
    "CollectiveError",
    "DPTokens",
    "ParallelConfig",
    "ParallelState",
    "all_gather_objects",
    "any_rank",
    "any_ranks",
    "attn_all_gather",
    "attn_all_reduce",
    "broadcast_object",
    "destroy_distributed",
    "gather_objects",
    "get_parallel_state",
    "init_distributed",
    "world_all_reduce",
]
