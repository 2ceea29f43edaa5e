"""PD prefill side: a request waits in the bootstrap queue until its decode rank's destination arrives
(``on_target``, forwarded by the prefill server's bootstrap server), is prefilled like any other request, and
instead of decoding, its KV, GDN conv and recurrent states and its first token are written into the decode
rank's memory by the Mooncake engine on a transfer thread (the inflight queue). What it held is freed when the
write completes; it then finishes with its one token."""

from __future__ import annotations

import concurrent.futures
import logging
import sys
import time
from typing import Any, NamedTuple

from sglang_lite.disaggregation.layout import Blocks, PoolLayout, request_blocks
from sglang_lite.disaggregation.transfer import MooncakeTransfer
from sglang_lite.mem_cache.request_memory import RequestMemory
from sglang_lite.scheduler.disagg.base import DONE, FAILED, TransferSide
from sglang_lite.scheduler.request import FinishReason, Req, ReqStatus

logger = logging.getLogger(__name__)
STATUS_RETRIES = 5
GIL_SWITCH_INTERVAL_S = 0.0005


class _MetaWrite(NamedTuple):
    session: str
    slot: int  # the staging row's state slot
    source: int
    target: int
    length: int


class _Job(NamedTuple):
    """One request's transfer, worked out on the scheduler's thread."""

    session: str
    blocks: Blocks
    meta: _MetaWrite
    token: int


class _Refused(NamedTuple):
    """A transfer that cannot be made: only its FAILED status is written."""

    error: Exception
    meta: _MetaWrite


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
        # The transfer thread needs the GIL to start a write and to return from it, and the forward's Python holds
        # it: a waiting thread gets it after the switch interval (5 ms by default), which a write then takes
        # several times over (docs/pd.md measures it). The interval matters only while another thread waits for
        # the GIL, so a shorter one costs the forward a handoff per write, not a slice of every step.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)

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
        decoding here (not for a re-prefill after a retraction, which has no room). The blocks are worked out
        here, so that the transfer thread runs little Python (each return to Python waits for the GIL, which the
        forward holds)."""
        if req.bootstrap_room is None:
            return False
        req.status = ReqStatus.TRANSFERRING
        try:
            job = self._job(req, token)
        except Exception as error:  # the destination does not fit this rank: the write fails
            job = _Refused(error, self._meta_write(req.transfer_target, req.state_slot))
        self.inflight.append((req, self._executor.submit(self._send, job)))
        # the token is not appended here: a first token that ends the request (a stop token, max_new_tokens 1)
        # would release its memory while the transfer thread reads it; it is appended when the write is done
        return True

    def _job(self, req: Req, token: int) -> _Job:
        target = req.transfer_target
        dst = PoolLayout.from_dict(target["layout"])
        self.layout.check_matches(dst)
        n = len(req.input_ids)
        pages = self.memory.pages_of(req, n)
        blocks = request_blocks(
            self.layout, dst, pages, target["kv_pages"], n, req.state_slot, target["state_slot"]
        )
        return _Job(dst.session, blocks, self._meta_write(target, req.state_slot), token)

    def _meta_write(self, target: dict[str, Any], slot: int) -> _MetaWrite:
        """The write of metadata row ``slot`` (a staging row) into the decode rank's row for the request."""
        base, row = target["layout"]["meta"]
        source = self.meta[slot].data_ptr()
        return _MetaWrite(
            target["layout"]["session"], slot, source, base + target["meta_row"] * row, row
        )

    def _send(self, job: _Job | _Refused) -> tuple[int, float]:
        """On the transfer thread: the data in one batch, then the metadata row (status and token) that tells the
        decode rank; returns the bytes and seconds of the data."""
        meta = job.meta
        try:
            if isinstance(job, _Refused):
                raise job.error
            start = time.perf_counter()
            sent = self.transfer.write(job.session, *job.blocks)
            seconds = time.perf_counter() - start
            self._meta_rows[meta.slot] = (DONE, job.token, sent, int(seconds * 1e9))
        except Exception:
            self._meta_rows[meta.slot] = (FAILED, -1, 0, 0)
            for attempt in range(STATUS_RETRIES):  # a write right after a failed batch can fail too
                try:
                    self.transfer.write(meta.session, [meta.source], [meta.target], [meta.length])
                    break
                except Exception:
                    time.sleep(0.05 * (attempt + 1))  # the decode side times out if every try fails
            raise
        self.transfer.write(meta.session, [meta.source], [meta.target], [meta.length])
        return sent, seconds

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
                self.transfer.stats.record(*future.result())
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
        writing = sum(1 for _, future in self.inflight if not future.done())
        return {
            "prefill_prealloc_queue_reqs": len(self.bootstrap),
            "prefill_inflight_queue_reqs": len(self.inflight),
            **self.transfer_figures(writing),
        }

    def take_notices(self) -> list[dict[str, Any]]:
        return []
