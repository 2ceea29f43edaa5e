"""PD prefill side: a request waits in the bootstrap queue until its decode rank's destination arrives
(``on_target``, forwarded by the prefill server's bootstrap server), is prefilled like any other request, and
instead of decoding, its KV, GDN conv and recurrent states and its first token are written into the decode
rank's memory by the Mooncake engine on a transfer thread (the inflight queue). What it held is freed when the
write completes; it then finishes with its one token."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any

import torch

from sglang_lite.disaggregation.layout import PoolLayout, request_blocks
from sglang_lite.disaggregation.transfer import MooncakeTransfer
from sglang_lite.mem_cache.request_memory import RequestMemory
from sglang_lite.scheduler.disagg.base import DONE, FAILED, TransferSide
from sglang_lite.scheduler.request import FinishReason, Req, ReqStatus

logger = logging.getLogger(__name__)
STATUS_RETRIES = 5


class PrefillSide(TransferSide):
    mode = "prefill"

    def __init__(self, transfer: MooncakeTransfer, memory: RequestMemory, timeout_s: float) -> None:
        super().__init__(transfer, memory, timeout_s)
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
            self.host.enqueue(req)
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
        self.host.enqueue(req)

    def on_prefilled(self, req: Req, token: int) -> bool:
        """The prompt is computed and its first token sampled: both are written to the decode rank instead of
        decoding here (not for a re-prefill after a retraction, which has no room)."""
        if req.bootstrap_room is None:
            return False
        req.status = ReqStatus.TRANSFERRING
        target = req.transfer_target
        dst = PoolLayout.from_dict(target["layout"])
        slots = self.memory.slots_of(req, len(req.input_ids))
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
            self.host.end(
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
                self.host.end(req, FinishReason("abort", message="aborted by the client"))
            elif error is not None:
                logger.error("KV transfer of %s failed: %s", req.rid, error)
                self.host.end(
                    req, self.failure(f"KV transfer to the decode server failed: {error}")
                )
            else:
                self.host.finish_transferred(req, int(self.meta[req.state_slot, 1]))

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
            self.host.end(req, reason)
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
