"""Prefill/decode disaggregation inside one scheduler: SGLang's PD queues on each side.

Prefill side: a request waits in the bootstrap queue until its decode rank's destination arrives (``on_target``,
forwarded by the prefill server's bootstrap server), is prefilled like any other request, and instead of decoding,
its KV, GDN conv and recurrent states and its first token are written into the decode rank's memory by the
Mooncake engine on a transfer thread (the inflight queue). What it held is freed when the write completes; it then
finishes with its one token.

Decode side: a request waits in the prealloc queue until KV slots for its prompt, a request row and a state slot
are free; they are reserved, its metadata row is cleared, and the reservation goes to the prefill side (a notice
the front end forwards to the bootstrap server). It then waits in the transfer queue, polling its metadata row, and
joins the running batch with the transferred first token. A transfer that fails, or does not finish within the
timeout, fails the request and frees the reservation; an aborted reservation stays held until the prefill side can
no longer write into it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from sglang_lite.disaggregation.layout import PoolLayout, request_blocks
from sglang_lite.disaggregation.transfer import MooncakeTransfer
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.protocol.outputs import INTERNAL_ERROR
from sglang_lite.scheduler.request import FinishReason, Req, ReqStatus

if TYPE_CHECKING:
    from sglang_lite.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)
PENDING, DONE, FAILED = 0, 1, 2  # a metadata row's status: written last by the prefill side
STATUS_RETRIES = 5
MODES = ("null", "prefill", "decode")


def _pool_buffers(pools: ModelPools) -> list[torch.Tensor]:
    return (
        pools.kv.k_buffers + pools.kv.v_buffers + pools.states.conv_states + pools.states.ssm_states
    )


class _Side:
    mode = "null"

    def __init__(self, transfer: MooncakeTransfer, pools: ModelPools, timeout_s: float) -> None:
        self.transfer, self.pools, self.timeout_s = transfer, pools, timeout_s
        # one (status, first token, bytes sent, nanoseconds the write took) row per state slot: the decode side's
        # are written by the prefill side, the prefill side's are the staging rows it writes from
        self.meta = torch.zeros(pools.states.allocator.size + 1, 4, dtype=torch.int64)
        transfer.register([*_pool_buffers(pools), self.meta])
        self.layout = PoolLayout.of(transfer.session_id, pools, self.meta)
        self.scheduler: Scheduler | None = None

    def bind(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def failure(self, message: str) -> FinishReason:
        return FinishReason("abort", message=message, status_code=INTERNAL_ERROR)

    def transfer_figures(self) -> dict[str, float]:
        stats = self.transfer.stats
        return {
            "kv_transfer_speed_gb_s": stats.last_speed_gb_s,
            "kv_transfer_latency_ms": stats.last_latency_ms,
            "kv_transfer_bytes_total": stats.bytes,
            "kv_transfer_seconds_total": stats.seconds,
            "kv_transfers_total": stats.transfers,
        }


class PrefillSide(_Side):
    mode = "prefill"

    def __init__(self, transfer: MooncakeTransfer, pools: ModelPools, timeout_s: float) -> None:
        super().__init__(transfer, pools, timeout_s)
        self.bootstrap: dict[int, Req] = {}  # room -> request waiting for its destination
        self.deadlines: dict[int, float] = {}
        self.targets: dict[
            int, tuple[dict[str, Any], float]
        ] = {}  # destinations that came before their request
        self.inflight: list[tuple[Req, concurrent.futures.Future]] = []
        self.aborted: set[str] = set()  # inflight requests aborted meanwhile
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-transfer")

    # ---- queues ------------------------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        if req.bootstrap_room in self.targets:
            req.transfer_target = self.targets.pop(req.bootstrap_room)[0]
            self.scheduler.waiting.append(req)
        else:
            self.bootstrap[req.bootstrap_room] = req
            self.deadlines[req.bootstrap_room] = time.monotonic() + self.timeout_s

    def on_target(self, room: int, target: dict[str, Any]) -> None:
        """The decode rank's destination for ``room`` (it may come before or after the request)."""
        req = self.bootstrap.pop(room, None)
        if req is None:
            self.targets[room] = (target, time.monotonic())
            return
        self.deadlines.pop(room, None)
        req.transfer_target = target
        self.scheduler.waiting.append(req)

    def on_prefilled(self, req: Req, token: int) -> None:
        """The prompt is cached and its first token sampled: write both to the decode rank instead of decoding."""
        req.status = ReqStatus.TRANSFERRING
        target = req.transfer_target
        dst = PoolLayout.from_dict(target["layout"])
        slots = self.pools.req_to_token.req_to_token[req.req_row, : len(req.input_ids)].tolist()
        job = (dst, slots, target, req.state_slot, token)
        self.inflight.append((req, self._executor.submit(self._send, *job)))

    def _send(
        self, dst: PoolLayout, slots: list[int], target: dict[str, Any], slot: int, token: int
    ) -> None:
        """On the transfer thread: the data, then the metadata row (status and token) that tells the decode rank."""
        meta_base, meta_row = dst.meta
        meta_target = [meta_base + target["meta_row"] * meta_row]
        try:
            self.layout.check_matches(dst)
            start = time.perf_counter()
            sent = self.transfer.write(
                dst.session,
                *request_blocks(
                    self.layout, dst, slots, target["kv_slots"], slot, target["state_slot"]
                ),
            )
            self.meta[slot] = torch.tensor(
                [DONE, token, sent, int((time.perf_counter() - start) * 1e9)]
            )
        except Exception:
            self.meta[slot] = torch.tensor([FAILED, -1, 0, 0])
            for attempt in range(
                STATUS_RETRIES
            ):  # a write right after a failed batch can fail too: try again
                try:
                    self.transfer.write(
                        dst.session, [self.meta[slot].data_ptr()], meta_target, [meta_row]
                    )
                    break
                except Exception:
                    time.sleep(0.05 * (attempt + 1))  # the decode side times out if every try fails
            raise
        self.transfer.write(dst.session, [self.meta[slot].data_ptr()], meta_target, [meta_row])

    def poll(self) -> None:
        now = time.monotonic()
        for room in [r for r, deadline in self.deadlines.items() if deadline < now]:
            req = self.bootstrap.pop(room)
            del self.deadlines[room]
            self.scheduler.end_request(
                req,
                self.failure(
                    f"no destination from the decode server for bootstrap_room {room} within {self.timeout_s:g} s"
                ),
            )
        for room in [r for r, (_, seen) in self.targets.items() if seen + self.timeout_s < now]:
            del self.targets[room]  # its request never came
        done = [(req, future) for req, future in self.inflight if future.done()]
        for req, future in done:
            self.inflight.remove((req, future))
            error = future.exception()
            if req.rid in self.aborted:
                self.aborted.discard(req.rid)
                self.scheduler.end_request(
                    req, FinishReason("abort", message="aborted by the client")
                )
            elif error is not None:
                logger.error("KV transfer of %s failed: %s", req.rid, error)
                self.scheduler.end_request(
                    req, self.failure(f"KV transfer to the decode server failed: {error}")
                )
            else:
                self.scheduler.finish_transferred(req, int(self.meta[req.state_slot, 1]))

    # ---- what the scheduler asks -------------------------------------------------------------------------------
    def find(self, rid: str) -> Req | None:
        return next(
            (r for r in [*self.bootstrap.values(), *(r for r, _ in self.inflight)] if r.rid == rid),
            None,
        )

    def abort(self, req: Req, reason: FinishReason) -> bool:
        """True when handled here (the request is in a PD queue)."""
        if self.bootstrap.get(req.bootstrap_room) is req:
            del self.bootstrap[req.bootstrap_room]
            self.deadlines.pop(req.bootstrap_room, None)
            self.scheduler.end_request(req, reason)
            return True
        if any(r is req for r, _ in self.inflight):
            self.aborted.add(req.rid)  # its memory is being read: freed when the write completes
            return True
        return False

    def rooms(self) -> set[int]:
        return set(self.bootstrap) | {r.bootstrap_room for r, _ in self.inflight}

    def waiting_reqs(self) -> list[Req]:
        """Requests of the PD queues that hold nothing yet (their prompt tokens count as still to come)."""
        return list(self.bootstrap.values())

    @property
    def has_work(self) -> bool:
        return bool(self.bootstrap or self.inflight)

    def held(self) -> list[Req]:
        return [r for r, _ in self.inflight]

    def loads(self) -> dict[str, Any]:
        return {
            "prefill_prealloc_queue_reqs": len(self.bootstrap),
            "prefill_inflight_queue_reqs": len(self.inflight),
            **self.transfer_figures(),
        }

    def take_notices(self) -> list[dict[str, Any]]:
        return []


class DecodeSide(_Side):
    mode = "decode"

    def __init__(self, transfer: MooncakeTransfer, pools: ModelPools, timeout_s: float) -> None:
        super().__init__(transfer, pools, timeout_s)
        self.prealloc: list[Req] = []
        self.transferring: list[Req] = []
        self.deadlines: dict[str, float] = {}
        self.draining: list[
            tuple[Req, float]
        ] = []  # aborted reservations the prefill side may still write into
        self.notices: list[dict[str, Any]] = []

    def add(self, req: Req) -> None:
        self.prealloc.append(req)

    def poll(self) -> None:
        self._reserve()
        self._check_transfers()

    def _reserve(self) -> None:
        """Reserves memory for the prealloc queue in order, while it fits beside what running requests need."""
        scheduler, pools = self.scheduler, self.pools
        while self.prealloc:
            req = self.prealloc[0]
            n = len(req.input_ids)
            rows_free = min(pools.req_to_token.allocator.num_free, pools.states.allocator.num_free)
            if (
                rows_free == 0
                or pools.kv.allocator.num_free - scheduler.reserved_decode_tokens() < n + 1
            ):
                return
            self.prealloc.pop(0)
            (row,) = pools.req_to_token.allocator.alloc(1)
            (slot,) = pools.states.alloc(1)
            kv_slots = pools.kv.allocator.alloc(n)
            table = pools.req_to_token.req_to_token
            table[row, :n] = torch.tensor(kv_slots, dtype=table.dtype, device=table.device)
            self.meta[slot].zero_()
            req.req_row, req.state_slot, req.num_cached = row, slot, n
            req.status = ReqStatus.TRANSFERRING
            scheduler.note_admission(req)
            scheduler.sampler.on_admit(
                req
            )  # penalties and grammars follow its tokens from the first one
            self.transferring.append(req)
            self.deadlines[req.rid] = time.monotonic() + self.timeout_s
            target = {
                "layout": self.layout.to_dict(),
                "kv_slots": kv_slots,
                "state_slot": slot,
                "meta_row": slot,
            }
            self.notices.append({"rid": req.rid, "room": req.bootstrap_room, "target": target})

    def _check_transfers(self) -> None:
        now = time.monotonic()
        for req in list(self.transferring):
            status = int(self.meta[req.state_slot, 0])
            if status == PENDING and now < self.deadlines[req.rid]:
                continue
            self.transferring.remove(req)
            del self.deadlines[req.rid]
            if status == DONE:
                _, token, sent, nanoseconds = self.meta[req.state_slot].tolist()
                self.transfer.stats.record(
                    sent, nanoseconds / 1e9
                )  # as the prefill side timed its write
                self.scheduler.join_decoding(req, token)
            elif status == FAILED:
                self.scheduler.end_request(
                    req, self.failure("the prefill server's KV transfer failed")
                )
            else:
                self._drain(
                    req,
                    self.failure(
                        f"KV transfer from the prefill server did not finish within "
                        f"{self.timeout_s:g} s"
                    ),
                )
        for req, deadline in list(self.draining):
            if int(self.meta[req.state_slot, 0]) != PENDING or deadline < now:
                self.draining.remove((req, deadline))
                self.pools.free_request(req.req_row, req.num_cached, req.state_slot)
                req.req_row = req.state_slot = None
                req.num_cached = 0

    def _drain(self, req: Req, reason: FinishReason) -> None:
        """Ends the request now, but keeps its reservation until the prefill side can no longer write into it."""
        self.draining.append((req, time.monotonic() + self.timeout_s))
        self.scheduler.end_request(req, reason, keep_memory=True)

    def find(self, rid: str) -> Req | None:
        return next((r for r in self.prealloc + self.transferring if r.rid == rid), None)

    def abort(self, req: Req, reason: FinishReason) -> bool:
        if req in self.prealloc:
            self.prealloc.remove(req)
            self.scheduler.end_request(req, reason)
            return True
        if req in self.transferring:
            self.transferring.remove(req)
            del self.deadlines[req.rid]
            self._drain(req, reason)
            return True
        return False

    def rooms(self) -> set[int]:
        return {r.bootstrap_room for r in self.prealloc + self.transferring}

    def waiting_reqs(self) -> list[Req]:
        """Requests waiting in the PD queues: the prealloc queue holds nothing yet; the transfer queue holds its
        reserved KV (counted as used) but has not started decoding."""
        return self.prealloc + self.transferring

    @property
    def has_work(self) -> bool:
        return bool(self.prealloc or self.transferring or self.draining)

    def held(self) -> list[Req]:
        return self.transferring + [r for r, _ in self.draining]

    def loads(self) -> dict[str, Any]:
        return {
            "decode_prealloc_queue_reqs": len(self.prealloc),
            "decode_transfer_queue_reqs": len(self.transferring),
            **self.transfer_figures(),
        }

    def take_notices(self) -> list[dict[str, Any]]:
        notices, self.notices = self.notices, []
        return notices


def create_side(
    mode: str, transfer: MooncakeTransfer, pools: ModelPools, timeout_s: float
) -> PrefillSide | DecodeSide:
    return (PrefillSide if mode == "prefill" else DecodeSide)(transfer, pools, timeout_s)
