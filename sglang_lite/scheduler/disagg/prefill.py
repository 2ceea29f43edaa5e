"""PD prefill side: a request waits in the bootstrap queue until its decode rank's destination arrives
(``on_target``, forwarded by the prefill server's bootstrap server), is prefilled like any other request, and
instead of decoding, its KV, GDN conv and recurrent states, first token and log-probabilities are written into the
decode DP rank's memory by the Mooncake engine on a transfer thread (the inflight queue). Under tensor parallelism
every rank of this DP rank's attention group writes the heads it holds into each decode rank that holds them too,
then its own metadata sub-row there. What the request held is freed once every rank of the group is done (they
agree first: their pools must stay identical); it then finishes with its one token."""

from __future__ import annotations

import concurrent.futures
import logging
import sys
import time
from typing import Any, NamedTuple

import torch

from sglang_lite.disaggregation.extras import ExtrasArea, extras_size
from sglang_lite.disaggregation.extras import encode as encode_extras
from sglang_lite.disaggregation.layout import (
    MAX_SOURCES,
    META_FIELDS,
    Blocks,
    Meta,
    PoolLayout,
    request_blocks,
)
from sglang_lite.scheduler.disagg.base import DONE, FAILED, PENDING, TransferSide
from sglang_lite.scheduler.request import FinishReason, Req, ReqStatus

logger = logging.getLogger(__name__)
STATUS_RETRIES = 5
GIL_SWITCH_INTERVAL_S = 0.0005
# On the CPU the writes of a forward's requests start at the next poll, which waits up to this long for them before
# the next forward: the forward's threads (and this thread's Python, which the transfer thread needs the GIL from)
# would otherwise share the cores with the engine's, and a ~1 ms write then takes several (docs/pd.md). A write
# that takes longer (a slow or dead peer) is polled as before.
CPU_SETTLE_S = 0.05


class _Write(NamedTuple):
    """One decode rank's share of a request's transfer."""

    session: str
    blocks: Blocks
    meta: int  # the address of this rank's metadata sub-row there
    extras: int | None  # where the log-probabilities go there (the group's first rank sends them)


class _Job(NamedTuple):
    """One request's transfer, worked out on the scheduler's thread."""

    writes: list[_Write]
    slot: int  # the request's state slot: its staging metadata row here
    token: int
    cached: int  # prompt tokens the prefix cache served
    extras: torch.Tensor | None  # the log-probabilities' bytes
    refused: Exception | None  # the destination does not fit this rank: only FAILED is written


class PrefillSide(TransferSide):
    mode = "prefill"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.group.size > MAX_SOURCES:
            raise ValueError(
                f"PD prefill runs with at most {MAX_SOURCES} ranks per attention group "
                f"(got {self.group.size})"
            )
        self.bootstrap: dict[int, Req] = {}  # room -> request waiting for its destination
        # deadlines and arrival times are set at the next poll, from the group's clock
        self.deadlines: dict[int, float | None] = {}
        self.targets: dict[int, tuple[dict[str, Any], float | None]] = {}
        self.inflight: list[tuple[Req, concurrent.futures.Future]] = []
        self.aborted: set[str] = set()  # inflight requests aborted meanwhile
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-transfer")
        # on the CPU the forward runs on the cores: a forward's writes are staged and submitted at the next poll
        self._settles = self.memory.pools.kv.buffer.device.type == "cpu"
        self._staged: list[tuple[concurrent.futures.Future, _Job]] = []
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
            self.deadlines[req.bootstrap_room] = None

    def on_target(self, room: int, target: dict[str, Any]) -> None:
        """The decode rank's destination for ``room`` (it may come before or after the request)."""
        req = self.bootstrap.pop(room, None)
        if req is None:
            self.targets[room] = (target, None)
            return
        self.deadlines.pop(room, None)
        req.transfer_target = target
        self.host.enqueue(req)

    def on_prefilled(self, req: Req, token: int) -> bool:
        """The prompt is computed and its first token sampled: both are written to the decode rank instead of
        decoding here (not for a re-prefill after a retraction, which has no room). The token is appended when the
        write is done (one that ended the request would free its memory while the transfer thread reads it). The
        blocks are worked out here, so that the transfer thread runs little Python (each return to Python waits
        for the GIL, which the forward holds)."""
        if req.bootstrap_room is None:
            return False
        req.status = ReqStatus.TRANSFERRING
        n = len(req.input_ids)
        sends_extras = self.group.rank == 0 and extras_size(req.logprob, n)
        # taken now: the request's own output takes the entries later
        extras = encode_extras(req.logprob_record.entries, req.logprob, n) if sends_extras else None
        layouts = [PoolLayout.from_dict(d) for d in req.transfer_target["layouts"]]
        refused = None
        try:
            writes = [self._write_of(req, dst, extras is not None) for dst in layouts]
        except Exception as error:  # the destination does not fit this rank: the write fails
            refused = error
            writes = [self._write_of(req, dst, False, data=False) for dst in layouts]
        job = _Job(writes, req.state_slot, token, req.prompt_tokens_from_cache, extras, refused)
        if self._settles:
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._staged.append((future, job))
        else:
            future = self._executor.submit(self._send, job)
        self.inflight.append((req, future))
        return True

    def _write_of(self, req: Req, dst: PoolLayout, extras: bool, data: bool = True) -> _Write:
        target = req.transfer_target
        meta = dst.meta_address(target["meta_row"], self.group.rank)
        where = dst.extras[0] + target["extras"][0] if extras else None
        if not data:
            return _Write(dst.session, ([], [], []), meta, None)
        self.layout.check_matches(dst)
        n = len(req.input_ids)
        pages = self.memory.pages_of(req, n)
        blocks = request_blocks(
            self.layout, dst, pages, target["kv_pages"], n, req.state_slot, target["state_slot"]
        )
        return _Write(dst.session, blocks, meta, where)

    # ---- the transfer thread -----------------------------------------------------------------------------------
    def _send(self, job: _Job) -> tuple[int, int, float]:
        """The data into every decode rank of the group, then this rank's metadata sub-row in each; returns the
        first token, and the bytes and seconds of the data."""
        try:
            if job.refused is not None:
                raise job.refused
            start = time.perf_counter()
            sent = [self._write_data(job, write) for write in job.writes]
            seconds = time.perf_counter() - start
        except Exception:
            for write in job.writes:
                self._write_meta(job, write, (FAILED, 0, 0), retries=STATUS_RETRIES)
            raise
        for write, nbytes in zip(job.writes, sent):
            self._write_meta(job, write, (DONE, nbytes, int(seconds * 1e9)))
        return job.token, sum(sent), seconds

    def _write_data(self, job: _Job, write: _Write) -> int:
        sources, targets, lengths = (list(x) for x in write.blocks)
        if write.extras is not None:
            sources.append(self._stage(job.extras))
            targets.append(write.extras)
            lengths.append(job.extras.numel())
        return self.transfer.write(write.session, sources, targets, lengths)

    def _stage(self, data: torch.Tensor) -> int:
        """``data`` in this rank's registered extras area (one transfer at a time uses it); its address."""
        if data.numel() > self.extras.size:
            self.transfer.unregister(self.extras.buffer)
            self.extras = ExtrasArea(2 * data.numel())
            self.transfer.register([self.extras.buffer])
        self.extras.buffer[: data.numel()] = data
        return self.extras.buffer.data_ptr()

    def _write_meta(
        self, job: _Job, write: _Write, outcome: tuple[int, int, int], retries: int = 1
    ) -> None:
        """This rank's sub-row (staged in its own row 0 of the request's slot) into the decode rank's."""
        status, nbytes, nanos = outcome
        row = self._meta_rows[job.slot, 0]
        row[:] = 0
        row[[Meta.TOKEN, Meta.BYTES, Meta.NANOS]] = (job.token, nbytes, nanos)
        row[[Meta.SOURCES, Meta.CACHED, Meta.STATUS]] = (self.group.size, job.cached, status)
        source = self.meta[job.slot, 0].data_ptr()
        for attempt in range(retries):  # a write right after a failed batch can fail too: try again
            try:
                self.transfer.write(write.session, [source], [write.meta], [META_FIELDS * 8])
                return
            except Exception:
                if attempt + 1 == retries:
                    raise
                time.sleep(0.05 * (attempt + 1))  # the decode side times out if every try fails

    # ---- the scheduler thread ----------------------------------------------------------------------------------
    def poll(self) -> None:
        if not (self.bootstrap or self.targets or self.inflight):
            return
        self._settle()
        local = [self._local_status(future) for _, future in self.inflight]
        self.now, statuses = self.group.agree(local)
        self._expire()
        for (req, future), status in zip(list(self.inflight), statuses):
            if status != PENDING:
                self.inflight.remove((req, future))
                self._finish(req, future, status)

    def _settle(self) -> None:
        """On the CPU: submits the writes of the last forward's requests and waits for them (at most
        ``CPU_SETTLE_S``), so that neither the forward's threads nor this thread's Python run beside them."""
        if not self._staged:
            return
        staged, self._staged = self._staged, []
        for future, job in staged:
            self._executor.submit(self._send_into, future, job)
        concurrent.futures.wait([future for future, _ in staged], timeout=CPU_SETTLE_S)

    def _send_into(self, future: concurrent.futures.Future, job: _Job) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(self._send(job))
        except Exception as error:
            future.set_exception(error)

    @staticmethod
    def _local_status(future: concurrent.futures.Future) -> int:
        if not future.done():
            return PENDING
        return FAILED if future.exception() is not None else DONE

    def _finish(self, req: Req, future: concurrent.futures.Future, status: int) -> None:
        if req.rid in self.aborted:
            self.aborted.discard(req.rid)
            self.host.end(req, FinishReason("abort", message="aborted by the client"))
        elif status == FAILED:
            error = future.exception() or "another rank of the attention group failed to send"
            logger.error("KV transfer of %s failed: %s", req.rid, error)
            self.host.end(req, self.failure(f"KV transfer to the decode server failed: {error}"))
        else:
            token, nbytes, seconds = future.result()
            self.transfer.stats.record(nbytes, seconds)
            self.host.finish_transferred(req, token)

    def _expire(self) -> None:
        """Requests whose destination did not come in time fail; destinations whose request never came go."""
        for room, deadline in list(self.deadlines.items()):
            if deadline is None:
                self.deadlines[room] = self.now + self.timeout_s
            elif deadline < self.now:
                del self.deadlines[room]
                message = (
                    f"no destination from the decode server for bootstrap_room {room} within "
                    f"{self.timeout_s:g} s"
                )
                self.host.end(self.bootstrap.pop(room), self.failure(message))
        for room, (target, seen) in list(self.targets.items()):
            if seen is None:
                self.targets[room] = (target, self.now)
            elif seen + self.timeout_s < self.now:
                del self.targets[room]

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
