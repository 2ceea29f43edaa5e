"""The collectives the model and the scheduler loop run, over the groups of ``parallel_state``.

Every call is a no-op in a group of one. A collective that fails (a peer died: gloo reports the closed connection;
a peer hung: the group's timeout expires) raises ``CollectiveError``, which ends the rank (``scheduler.faults``):
its peers fail the same way, and the front end marks the world's DP ranks failed instead of waiting forever.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from sglang_lite.distributed.parallel_state import get_parallel_state

F = TypeVar("F", bound=Callable[..., Any])
# torch 2.13 renamed all_gather_into_tensor (a warning each call); older builds have only the old name
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CollectiveError(RuntimeError):
    """A collective of a multi-rank world failed: a peer is dead or hung. The world cannot go on."""


def _collective(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CollectiveError:
            raise
        except Exception as error:  # gloo: RuntimeError / DistBackendError; a timeout: DistError
            state = get_parallel_state()
            raise CollectiveError(
                f"{fn.__name__} failed on rank {state.rank} of {state.world_size}: "
                f"{type(error).__name__}: {error}"
            ) from error

    return wrapper  # type: ignore[return-value]


# ---- tensors (the model) -------------------------------------------------------------------------------------------
def attn_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the attention group (a row-parallel projection's partial outputs), in place."""
    state = get_parallel_state()
    return _all_reduce(x, state.attn) if state.attn_tp_size > 1 else x


def world_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the whole world (the MLP / MoE partial outputs), in place."""
    state = get_parallel_state()
    return _all_reduce(x, state.world) if state.world_size > 1 else x


@_collective
def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    dist.all_reduce(x, group=group)
    return x


@_collective
def attn_all_gather(x: torch.Tensor) -> torch.Tensor:
    """Concatenates the attention group's shards along the last dimension (vocab-parallel logits)."""
    state = get_parallel_state()
    n = state.attn_tp_size
    if n == 1:
        return x
    x = x.contiguous()
    # gloo: concatenated only
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=state.attn)
    return torch.movedim(out.view(n, *x.shape), 0, -2).reshape(*x.shape[:-1], n * x.shape[-1])


class DPTokens:
    """DP attention: the MLP of every layer runs on the tokens of all DP ranks at once.

    Built once per forward (one small all-gather of the token counts); ``gather`` pads this rank's tokens to the
    largest count, all-gathers them and keeps one copy per attention group; ``scatter`` sums the ranks' partial MLP
    outputs and returns this group's rows. A DP rank with no tokens still takes part, with none.
    """

    def __init__(self, num_tokens: int, device: torch.device) -> None:
        state = get_parallel_state()
        self.state = state
        counts = torch.tensor([num_tokens], dtype=torch.int64, device=device)
        gathered = torch.empty(state.world_size, dtype=torch.int64, device=device)
        _all_gather_world(gathered, counts)
        per_rank = gathered.tolist()
        size = state.attn_tp_size
        self.counts = per_rank[::size]  # one per attention group (its ranks hold the same tokens)
        self.max_count = max(per_rank)
        group = state.attn_dp_rank
        self.begin = sum(self.counts[:group])
        self.end = self.begin + self.counts[group]

    @property
    def total(self) -> int:
        return sum(self.counts)

    @_collective
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This group's tokens [n, H] -> every group's tokens [total, H]."""
        padded = x.new_zeros((self.max_count, x.shape[-1]))
        padded[: x.shape[0]] = x
        out = x.new_empty((self.state.world_size * self.max_count, x.shape[-1]))
        _all_gather_single(out, padded, group=self.state.world)
        leaders = out.view(self.state.world_size, self.max_count, -1)[:: self.state.attn_tp_size]
        return torch.cat([rows[:n] for rows, n in zip(leaders, self.counts)])

    def scatter(self, y: torch.Tensor) -> torch.Tensor:
        """Every rank's partial MLP output [total, H] -> the sum, this group's rows [n, H]."""
        return world_all_reduce(y)[self.begin : self.end]


@_collective
def _all_gather_world(out: torch.Tensor, x: torch.Tensor) -> None:
    _all_gather_single(out, x, group=get_parallel_state().world)


# ---- host objects (the scheduler loop) ------------------------------------------------------------------------------
@_collective
def broadcast_object(obj: Any, group: dist.ProcessGroup | None, src: int = 0) -> Any:
    """``obj`` of world rank ``src`` on every rank of ``group`` (None: a group of one, ``obj`` itself)."""
    if group is None or dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


@_collective
def gather_objects(obj: Any, group: dist.ProcessGroup | None, dst: int = 0) -> list[Any] | None:
    """Every rank's ``obj`` at world rank ``dst`` (a list in group order), None elsewhere."""
    if group is None or dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


@_collective
def all_gather_objects(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj``, in group order, on every rank of ``group`` (None: a group of one)."""
    if group is None or dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def any_rank(flag: bool, group: dist.ProcessGroup | None) -> bool:
    """True when ``flag`` is true on any rank of ``group``."""
    return any_ranks((flag,), group)[0]


@_collective
def any_ranks(flags: tuple[bool, ...], group: dist.ProcessGroup | None) -> tuple[bool, ...]:
    """Each flag, true when it is true on any rank of ``group`` (one collective for all of them)."""
    if group is None or dist.get_world_size(group) == 1:
        return flags
    values = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return tuple(bool(v) for v in values.tolist())
