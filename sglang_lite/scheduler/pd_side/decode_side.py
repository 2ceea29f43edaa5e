"""PD decode side: a request waits in the prealloc queue until KV slots for its prompt, a request row, a state
slot and room for its log-probabilities are free; they are reserved, its metadata row is cleared, and the
reservation goes to the prefill side (a notice the front end forwards to the bootstrap server) with the layouts of
every rank of this DP rank's attention group, so that each prefill rank writes the heads each of them holds. It
then waits in the transfer queue, polling its metadata row (one sub-row per prefill rank that writes into this
rank), and joins the running batch with the transferred first token once every rank of the group has all of it.

A sub-row counts only when it carries the request's own room (a late status write of an earlier request in the same
slot is not this one's). FAILED means that none of that prefill rank's blocks can still land (``transfer.py``): the
reservation is freed at once. A transfer that does not finish within the timeout, or a request aborted while its
transfer is under way, fails at once but keeps its reservation until every prefill rank writing into it has
written its final status, or twice the timeout more has passed: the prefill side starts no write into a destination
older than half the timeout, and settles a failed write within the timeout, so by then its writes have ended or its
process is gone."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sglang_lite.pd_transport.extras import decode as decode_extras
from sglang_lite.pd_transport.extras import extras_size
from sglang_lite.pd_transport.layout import Meta
from sglang_lite.sampling.logprobs import LogprobParams
from sglang_lite.sampling.params import SamplingParams
from sglang_lite.scheduler.pd_side.base import DONE, FAILED, PENDING, TransferSide
from sglang_lite.scheduler.request import FinishReason, Req, ReqStatus

logger = logging.getLogger(__name__)
# a given-up reservation is held this many timeouts at most, waiting for the final statuses
DRAIN_TIMEOUTS = 2


class DecodeSide(TransferSide):
    mode = "decode"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prealloc: list[Req] = []
        self.transferring: list[Req] = []
        self.deadlines: dict[str, float] = {}
        self.reserved_extras: dict[str, tuple[int, int]] = {}  # rid -> offset, bytes
        # aborted reservations the prefill side may still write into, with their deadlines
        self.draining: list[tuple[Req, float]] = []
        self.notices: list[dict[str, Any]] = []

    def check(
        self,
        room: int | None,
        params: SamplingParams,
        logprob: LogprobParams | None,
        prompt_len: int,
        queued_rooms: Callable[[], set[int]],
    ) -> None:
        super().check(room, params, logprob, prompt_len, queued_rooms)
        need = extras_size(logprob, prompt_len)
        if need > self.extras.size:
            raise ValueError(
                f"return_logprob: the log-probabilities asked for take {need} bytes, more than this decode "
                f"server's PD transfer area ({self.extras.size} bytes): ask for fewer prompt positions "
                "(logprob_start_len) or top_logprobs_num"
            )

    def add(self, req: Req) -> None:
        self.prealloc.append(req)

    def poll(self) -> None:
        if self.prealloc or self.transferring or self.draining:
            self._check_transfers()
        self._reserve()

    def _reserve(self) -> None:
        """Reserves memory for the prealloc queue in order, while it fits beside what running requests need."""
        memory = self.memory
        while self.prealloc:
            req = self.prealloc[0]
            n = len(req.input_ids)
            kv_left = memory.free_tokens - self.host.reserved_decode_tokens()
            need = extras_size(req.logprob, n)
            if memory.free_rows == 0 or kv_left < memory.page_tokens(n + 1):
                return
            offset = self.extras.alloc(need)
            if offset is None:
                return
            self.prealloc.pop(0)
            # penalties and grammars follow its tokens from the first one (the memory's listeners)
            kv_pages = memory.reserve(req, n)
            self.meta[req.state_slot].zero_()
            req.status = ReqStatus.TRANSFERRING
            self.transferring.append(req)
            self.deadlines[req.rid] = self.now + self.timeout_s
            self.reserved_extras[req.rid] = (offset, need)
            target = {
                "layouts": self.group_layouts,
                "kv_pages": kv_pages,
                "state_slot": req.state_slot,
                "meta_row": req.state_slot,
                "extras": [offset, need],
            }
            self.notices.append({"rid": req.rid, "room": req.bootstrap_room, "target": target})

    def _local_status(self, req: Req) -> int:
        """What this rank's metadata row says: PENDING until every prefill rank writing here has written."""
        rows = self.meta[req.state_slot]
        mine = rows[:, Meta.ROOM] == req.bootstrap_room
        sources = int(rows[mine, Meta.SOURCES].max()) if bool(mine.any()) else 0
        statuses = [
            int(status) if own else PENDING
            for status, own in zip(rows[:sources, Meta.STATUS].tolist(), mine[:sources].tolist())
        ]
        if not sources or PENDING in statuses:
            return PENDING
        return FAILED if FAILED in statuses else DONE

    def _check_transfers(self) -> None:
        """Every rank of the group agrees on each transfer's outcome and on the clock, then acts alike."""
        held = self.transferring + [r for r, _ in self.draining]
        self.now, statuses = self.group.agree([self._local_status(r) for r in held])
        outcome = dict(zip(map(id, held), statuses))
        for req in list(self.transferring):
            status = outcome[id(req)]
            if status == PENDING and self.now < self.deadlines[req.rid]:
                continue
            self.transferring.remove(req)
            del self.deadlines[req.rid]
            if status == DONE:
                self._join(req)
            elif status == FAILED:
                self._release_extras(req)
                self.host.end(req, self.failure("the prefill server's KV transfer failed"))
            else:
                message = f"KV transfer from the prefill server did not finish within {self.timeout_s:g} s"
                self._drain(req, self.failure(message))
        for req, deadline in list(self.draining):
            if outcome[id(req)] != PENDING or deadline < self.now:
                self.draining.remove((req, deadline))
                self.memory.release(req, cache=False)

    def _join(self, req: Req) -> None:
        """The prompt's KV and states are here: the first token, its log-probabilities and the prefill side's
        cache hits become the request's, and it decodes from here."""
        rows = self.meta[req.state_slot]
        sources = int(rows[0, Meta.SOURCES])
        written = int(rows[:sources, Meta.BYTES].sum())
        self.transfer.stats.record(written, int(rows[:sources, Meta.NANOS].max()) / 1e9)
        req.prompt_tokens_from_cache = int(rows[0, Meta.CACHED])
        offset, need = self.reserved_extras[req.rid]
        if need:
            data = self.extras.buffer[offset : offset + need]
            req.logprob_record.entries = decode_extras(data, req.logprob, len(req.input_ids))
            req.logprob_record.input_upto = len(req.input_ids)
        self._release_extras(req)
        self.host.join_decoding(req, int(rows[0, Meta.TOKEN]))

    def _release_extras(self, req: Req) -> tuple[int, int]:
        offset, need = self.reserved_extras.pop(req.rid, (0, 0))
        self.extras.free(offset, need)
        return offset, need

    def _drain(self, req: Req, reason: FinishReason) -> None:
        """Ends the request now, but keeps its reservation until the prefill side can no longer write into it."""
        self.draining.append((req, self.now + DRAIN_TIMEOUTS * self.timeout_s))
        self._release_extras(req)
        self.host.end(req, reason, keep_memory=True)

    def find(self, rid: str) -> Req | None:
        return next((r for r in self.prealloc + self.transferring if r.rid == rid), None)

    def abort(self, req: Req, reason: FinishReason, settled: bool = False) -> bool:
        if req in self.prealloc:
            self.prealloc.remove(req)
            self.host.end(req, reason)
            return True
        if req in self.transferring:
            self.transferring.remove(req)
            del self.deadlines[req.rid]
            if settled:  # no write from the prefill side can come: freed now
                self._release_extras(req)
                self.host.end(req, reason)
            else:
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
