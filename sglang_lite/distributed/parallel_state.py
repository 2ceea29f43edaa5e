"""Process groups of tensor, expert and DP-attention parallelism, on ``torch.distributed``.

One *world* is the ``tp_size`` processes that run one model together (on one node or several). Inside it:
- the MLP / MoE group is the whole world: every rank holds 1/tp of each dense or shared MLP, and of each routed
  expert 1/moe_tp of the intermediate dimension (``moe_tp = tp / ep``) for the 1/ep of the experts it owns;
- the attention group is the ``attn_tp = tp / dp`` consecutive ranks of one DP-attention group (with DP attention
  off, the whole world): attention, the embedding and the LM head are split over it, and each attention group is
  one DP rank with its own scheduler, requests and pools.

Each group exists twice when the device is a GPU: on the device backend (NCCL, which is RCCL on ROCm builds) for
tensors, and on gloo for the host-side objects the scheduler loop exchanges. On the CPU both are the same gloo
group. Every group has a finite timeout (``--dist-timeout``): a dead or hung peer ends a collective with an error,
not an eternal wait.

The state is process-global, like the server arguments: the scheduler process sets it once
(``init_distributed``), model code reads it at construction (``get_parallel_state``). A process that never sets it
(a script, a test) runs one rank of one, and every collective is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelConfig:
    tp_size: int = 1
    ep_size: int = 1
    # DP-attention groups inside the world; without DP attention, replicas outside it
    dp_size: int = 1
    dp_attention: bool = False

    def __post_init__(self) -> None:
        for name in ("tp_size", "ep_size", "dp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tp_size % self.ep_size:
            raise ValueError(f"ep_size ({self.ep_size}) must divide tp_size ({self.tp_size})")
        if self.dp_attention and self.tp_size % self.dp_size:
            raise ValueError(
                f"with DP attention dp_size ({self.dp_size}) must divide tp_size ({self.tp_size})"
            )

    @property
    def world_size(self) -> int:
        return self.tp_size

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size // self.dp_size if self.dp_attention else self.tp_size

    @property
    def attn_dp_size(self) -> int:
        """DP ranks inside one world: the attention groups."""
        return self.dp_size if self.dp_attention else 1

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.ep_size


@dataclass(frozen=True)
class ParallelState:
    """Where this process sits in its world, and the groups it talks over (None in a world of one)."""

    config: ParallelConfig
    rank: int = 0
    world: dist.ProcessGroup | None = None  # device backend, all ranks
    attn: dist.ProcessGroup | None = None  # device backend, this rank's attention group
    cpu_world: dist.ProcessGroup | None = None  # gloo, all ranks (host objects)
    cpu_attn: dist.ProcessGroup | None = None  # gloo, this rank's attention group

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def attn_tp_size(self) -> int:
        return self.config.attn_tp_size

    @property
    def attn_tp_rank(self) -> int:
        return self.rank % self.config.attn_tp_size

    @property
    def attn_dp_rank(self) -> int:
        """The DP-attention group this rank belongs to (0 without DP attention)."""
        return self.rank // self.config.attn_tp_size

    @property
    def moe_ep_size(self) -> int:
        return self.config.ep_size

    @property
    def moe_ep_rank(self) -> int:
        return self.rank // self.config.moe_tp_size

    @property
    def moe_tp_size(self) -> int:
        return self.config.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.config.moe_tp_size


_SINGLE = ParallelState(ParallelConfig())
_state: ParallelState = _SINGLE


def get_parallel_state() -> ParallelState:
    return _state


def init_distributed(
    config: ParallelConfig, rank: int, init_address: str, device: str, timeout_s: float
) -> ParallelState:
    """Joins the world at ``init_address`` (``host:port`` of world rank 0's store) and builds its groups.

    Every rank of the world calls this with the same config; it returns once all of them have joined (or raises
    after ``timeout_s``). A world of one joins nothing.
    """
    global _state
    if config.world_size == 1:
        _state = ParallelState(config)
        return _state
    on_gpu = torch.device(device).type == "cuda"
    backend = "nccl" if on_gpu else "gloo"
    timeout = timedelta(seconds=timeout_s)
    # one GPU per rank: "cuda" means this node's rank-th device ("cuda" tensors then land there)
    if on_gpu:
        index = torch.device(device).index
        torch.cuda.set_device(rank % torch.cuda.device_count() if index is None else index)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{init_address}",
        world_size=config.world_size,
        rank=rank,
        timeout=timeout,
    )
    world = dist.group.WORLD
    cpu_world = dist.new_group(backend="gloo", timeout=timeout) if on_gpu else world
    attn = cpu_attn = None
    size = config.attn_tp_size
    # every rank creates every group, in the same order
    for first in range(0, config.world_size, size):
        ranks = list(range(first, first + size))
        group = dist.new_group(ranks, backend=backend, timeout=timeout)
        cpu_group = dist.new_group(ranks, backend="gloo", timeout=timeout) if on_gpu else group
        if rank in ranks:
            attn, cpu_attn = group, cpu_group
    _state = ParallelState(config, rank, world, attn, cpu_world, cpu_attn)
    return _state


def destroy_distributed() -> None:
    global _state
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = _SINGLE
