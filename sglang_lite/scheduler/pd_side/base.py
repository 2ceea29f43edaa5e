"""What the scheduler's loop asks of a rank's PD side, what the side may ask back, and the side of a rank that
serves whole requests (``NullSide``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from sglang_lite.distributed import all_gather_objects
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.mem_cache.request_memory import RequestMemory
from sglang_lite.pd_transport.extras import ExtrasArea
from sglang_lite.pd_transport.layout import MAX_SOURCES, META_FIELDS, PoolLayout, PoolShard
from sglang_lite.pd_transport.transfer import MooncakeTransfer
from sglang_lite.protocol.outputs import PD_FAILURE
from sglang_lite.sampling.logprobs import LogprobParams
from sglang_lite.sampling.params import SamplingParams
from sglang_lite.scheduler.request import FinishReason, Req

# a metadata sub-row's status: written last by the prefill side
PENDING = 0
DONE = 1
FAILED = 2  # none of the request's blocks can land any more: the decode side may free its pages
# (the prefill side's own) a write failed with blocks still under way: its memory stays held until they end
UNSETTLED = 3


class SideHost(Protocol):
    """The few things a PD side asks of its rank's scheduler."""

    def enqueue(self, req: Req) -> None:
        """The request may be prefilled now (it waits like any other)."""

    def end(self, req: Req, reason: FinishReason, keep_memory: bool = False) -> None:
        """Ends a request of a PD queue (``keep_memory``: the side releases its reservation later)."""

    def finish_transferred(self, req: Req, token: int) -> None:
        """Prefill side: the decode rank has the request; it ends here with its first token."""

    def join_decoding(self, req: Req, token: int) -> None:
        """Decode side: the prompt's KV and state arrived with the first token; it decodes from here."""

    def reserved_decode_tokens(self) -> int:
        """KV slots the rank's decoding requests are expected to need."""


class DisaggSide(Protocol):
    """A rank's side of prefill/decode disaggregation, as the scheduler's loop uses it."""

    mode: str
    takes_requests: bool  # new requests go to its queues (``add``), not the scheduler's

    def bind(self, host: SideHost) -> None: ...

    def check(
        self,
        room: int | None,
        params: SamplingParams,
        logprob: LogprobParams | None,
        prompt_len: int,
        queued_rooms: Callable[[], set[int]],
    ) -> None:
        """Raises ValueError (naming the field) for a request this side cannot take. ``queued_rooms``: the rooms
        of the scheduler's unfinished requests."""

    def add(self, req: Req) -> None:
        """Takes a new request into the PD queues."""

    def poll(self) -> None: ...

    def on_prefilled(self, req: Req, token: int) -> bool:
        """The request's prompt is computed and its first token sampled; True: the side sends them on."""

    def on_target(self, room: int, target: dict[str, Any]) -> None: ...

    def abort(self, req: Req, reason: FinishReason, settled: bool = False) -> bool:
        """True when the request was in a PD queue (it is ended or will be). ``settled``: the other side will
        write nothing more for it (its prefill refused it or died), so nothing it reserved need wait."""

    def find(self, rid: str) -> Req | None: ...

    def held(self) -> list[Req]:
        """Requests of the PD queues that hold memory."""

    def waiting_reqs(self) -> list[Req]:
        """Requests of the PD queues that wait (counted as waiting in the loads)."""

    @property
    def has_work(self) -> bool: ...

    def loads(self) -> dict[str, Any]: ...

    def take_notices(self) -> list[dict[str, Any]]: ...


class NullSide:
    """A rank that serves whole requests: no PD queue, nothing to send or receive."""

    mode = "null"
    takes_requests = False
    has_work = False

    def bind(self, host: SideHost) -> None:
        pass

    def check(
        self,
        room: int | None,
        params: SamplingParams,
        logprob: LogprobParams | None,
        prompt_len: int,
        queued_rooms: Callable[[], set[int]],
    ) -> None:
        pass

    def add(self, req: Req) -> None:
        raise TypeError("a rank that serves whole requests has no PD queue")

    def poll(self) -> None:
        pass

    def on_prefilled(self, req: Req, token: int) -> bool:
        return False

    def on_target(self, room: int, target: dict[str, Any]) -> None:
        raise TypeError("a transfer target reached a rank that is not a PD prefill rank")

    def abort(self, req: Req, reason: FinishReason, settled: bool = False) -> bool:
        return False

    def find(self, rid: str) -> Req | None:
        return None

    def held(self) -> list[Req]:
        return []

    def waiting_reqs(self) -> list[Req]:
        return []

    def loads(self) -> dict[str, Any]:
        return {}

    def take_notices(self) -> list[dict[str, Any]]:
        return []


def _pool_buffers(pools: ModelPools) -> list[torch.Tensor]:
    return [pools.kv.buffer, pools.states.conv_buffer, pools.states.ssm_buffer]


class AttentionGroup:
    """The ranks that hold one DP rank's requests, each with its own heads (one rank without tensor parallelism).

    Their schedulers must stay identical, so whatever a PD side decides from what differs between them (how far its
    own transfers got, its clock) is agreed first: ``agree`` gathers each rank's statuses and the group's first
    rank's clock."""

    def __init__(self, rank: int = 0, size: int = 1, group: Any = None) -> None:
        self.rank = rank
        self.size = size
        self.group = group

    def gather(self, obj: Any) -> list[Any]:
        return all_gather_objects(obj, self.group) if self.size > 1 else [obj]

    def agree(self, statuses: list[int]) -> tuple[float, list[int]]:
        """(the first rank's clock, each status agreed): PENDING while any rank's is, else UNSETTLED, else FAILED
        if any rank's is, else DONE."""
        if self.size == 1:
            return time.monotonic(), statuses
        gathered = self.gather((time.monotonic(), statuses))
        return gathered[0][0], [_agreed(column) for column in zip(*(s for _, s in gathered))]


def _agreed(statuses: tuple[int, ...]) -> int:
    for status in (PENDING, UNSETTLED, FAILED):
        if status in statuses:
            return status
    return DONE


class TransferSide:
    """What both PD sides share: the transfer engine with the pools registered, the metadata rows of the state
    slots (one sub-row per prefill rank that writes into a slot: ``layout.META_FIELDS`` int64, the status last; the
    decode side's are written by the prefill side, the prefill side's are the staging rows it writes from), the
    extras area (log-probabilities), the layouts of the attention group's ranks, and the checks of a new request."""

    mode = "null"
    takes_requests = True

    def __init__(
        self,
        transfer: MooncakeTransfer,
        memory: RequestMemory,
        timeout_s: float,
        group: AttentionGroup,
        shard: PoolShard,
        extras_bytes: int,
    ) -> None:
        pools = memory.pools
        self.transfer = transfer
        self.memory = memory
        self.timeout_s = timeout_s
        self.group = group
        rows = pools.states.allocator.size + 1
        self.meta = torch.zeros(rows, MAX_SOURCES, META_FIELDS, dtype=torch.int64)
        self._meta_rows = self.meta.numpy()  # the same memory, written without torch's dispatch
        self.extras = ExtrasArea(extras_bytes)
        transfer.register([*_pool_buffers(pools), self.meta, self.extras.buffer])
        self.layout = PoolLayout.of(
            transfer.session_id, pools, self.meta, self.extras.buffer, shard
        )
        # every rank's layout, in attention-group order (one collective, at start-up)
        self.group_layouts = self.group.gather(self.layout.to_dict())
        self.now = time.monotonic()  # the group's clock at the last poll
        self.host: SideHost | None = None

    def bind(self, host: SideHost) -> None:
        self.host = host

    def check(
        self,
        room: int | None,
        params: SamplingParams,
        logprob: LogprobParams | None,
        prompt_len: int,
        queued_rooms: Callable[[], set[int]],
    ) -> None:
        if room is None:
            raise ValueError(
                f"bootstrap_room: a {self.mode} server takes requests with bootstrap_host, "
                "bootstrap_port and bootstrap_room (send them through a PD router)"
            )
        if room in self.rooms() or room in queued_rooms():
            raise ValueError(f"bootstrap_room {room} is already in use by an unfinished request")
        if params.n > 1:
            raise ValueError("n: parallel samples (n > 1) are not supported with PD disaggregation")

    def rooms(self) -> set[int]:
        raise NotImplementedError

    def failure(self, message: str) -> FinishReason:
        """A request the PD pair failed (502: the other server or the transfer between them, not this one)."""
        return FinishReason("abort", message=message, status_code=PD_FAILURE)

    def on_target(self, room: int, target: dict[str, Any]) -> None:
        raise TypeError("a transfer target reached a rank that is not a PD prefill rank")

    def on_prefilled(self, req: Req, token: int) -> bool:
        return False

    def transfer_figures(self, in_flight: int) -> dict[str, Any]:
        """The transfers' figures of the loads: moving averages over the recent ones, totals, histograms."""
        stats = self.transfer.stats
        return {
            "kv_transfer_speed_gb_s": stats.speed_gb_s,
            "kv_transfer_latency_ms": stats.latency_ms,
            "kv_transfers_in_flight": in_flight,
            "kv_transfer_bytes_total": stats.bytes,
            "kv_transfer_seconds_total": stats.seconds,
            "kv_transfers_total": stats.transfers,
            "kv_transfer_latency_counts": list(stats.latency_counts),
            "kv_transfer_size_counts": list(stats.size_counts),
        }
