"""PD decode side: a request waits in the prealloc queue until KV slots for its prompt, a request row and a
state slot are free; they are reserved, its metadata row is cleared, and the reservation goes to the prefill
side (a notice the front end forwards to the bootstrap server). It then waits in the transfer queue, polling its
metadata row, and joins the running batch with the transferred first token. A transfer that fails, or does not
finish within the timeout, fails the request and frees the reservation; an aborted reservation stays held until
the prefill side can no longer write into it."""

from __future__ import annotations

import logging
import time
from typing import Any

from sglang_lite.disaggregation.transfer import MooncakeTransfer
from sglang_lite.mem_cache.request_memory import RequestMemory
from sglang_lite.scheduler.disagg.base import DONE, FAILED, PENDING, TransferSide
from sglang_lite.scheduler.request import FinishReason, Req, ReqStatus

logger = logging.getLogger(__name__)
STATUS_RETRIES = 5


class DecodeSide(TransferSide):
    mode = "decode"

    def __init__(self, transfer: MooncakeTransfer, memory: RequestMemory, timeout_s: float) -> None:
        super().__init__(transfer, memory, timeout_s)
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
        memory = self.memory
        while self.prealloc:
            req = self.prealloc[0]
            n = len(req.input_ids)
            kv_left = memory.free_tokens - self.host.reserved_decode_tokens()
            if memory.free_rows == 0 or kv_left < memory.page_tokens(n + 1):
                return
            self.prealloc.pop(0)
            # penalties and grammars follow its tokens from the first one (the memory's listeners)
            kv_pages = memory.reserve(req, n)
            self.meta[req.state_slot].zero_()
            req.status = ReqStatus.TRANSFERRING
            self.transferring.append(req)
            self.deadlines[req.rid] = time.monotonic() + self.timeout_s
            target = {
                "layout": self.layout.to_dict(),
                "kv_pages": kv_pages,
                "state_slot": req.state_slot,
                "meta_row": req.state_slot,
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
                self.host.join_decoding(req, token)
            elif status == FAILED:
                self.host.end(req, self.failure("the prefill server's KV transfer failed"))
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
                self.memory.release(req, cache=False)

    def _drain(self, req: Req, reason: FinishReason) -> None:
        """Ends the request now, but keeps its reservation until the prefill side can no longer write into it."""
        self.draining.append((req, time.monotonic() + self.timeout_s))
        self.host.end(req, reason, keep_memory=True)

    def find(self, rid: str) -> Req | None:
        return next((r for r in self.prealloc + self.transferring if r.rid == rid), None)

    def abort(self, req: Req, reason: FinishReason) -> bool:
        if req in self.prealloc:
            self.prealloc.remove(req)
            self.host.end(req, reason)
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
            # reserved and awaiting their data (the prefill side's queue and prefill included)
            **self.transfer_figures(len(self.transferring)),
        }

    def take_notices(self) -> list[dict[str, Any]]:
        notices, self.notices = self.notices, []
        return notices
