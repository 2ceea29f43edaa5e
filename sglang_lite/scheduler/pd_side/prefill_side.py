"""PD prefill side: a request waits in the bootstrap queue until its decode rank's destination arrives
(``on_target``, forwarded by the prefill server's bootstrap server), is prefilled like any other request, and
instead of decoding, its KV, GDN conv and recurrent states, first token and log-probabilities are written into the
decode DP rank's memory by the Mooncake engine on a transfer thread (the inflight queue; ``transfer_threads.py``). Under
tensor parallelism every rank of this DP rank's attention group writes the heads it holds into each decode rank
that holds them too, then its own metadata sub-row there. What the request held is freed once every rank of the
group is done (they agree first: their pools must stay identical); it then finishes with its one token. A write
that failed with blocks still under way keeps the request's memory (``unsettled``) until the engine ends them."""

from __future__ import annotations

import concurrent.futures
import logging
import sys
import time
from typing import Any

from sglang_lite.pd_transport.extras import encode as encode_extras
from sglang_lite.pd_transport.extras import extras_size
from sglang_lite.pd_transport.layout import MAX_SOURCES, PoolLayout, request_blocks
from sglang_lite.pd_transport.transfer import TransferError
from sglang_lite.scheduler.pd_side.base import DONE, FAILED, PENDING, UNSETTLED, TransferSide
from sglang_lite.scheduler.pd_side.transfer_threads import Job, Sender, Write
from sglang_lite.scheduler.request import FinishReason, Req, ReqStatus

logger = logging.getLogger(__name__)
GIL_SWITCH_INTERVAL_S = 0.0005
# On the CPU the writes of a forward's requests start at the next poll, which waits up to this long for them before
# the next forward: the forward's threads (and this thread's Python, which the transfer thread needs the GIL from)
# would otherwise share the cores with the engine's, and a ~1 ms write then takes several (docs/pd.md). A write
# that takes longer (a slow or dead peer) is polled as before.
CPU_SETTLE_S = 0.05
RECEIVED = "received_at"  # the key a destination gets: when it reached this rank (its clock)


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
        # ended requests whose failed write may still read their memory: (request, its batches under way, the
        # time their memory may be reused all the same), held until the engine ends those batches
        self.unsettled: list[tuple[Req, tuple[int, ...], float | None]] = []
        # the transfer threads, one per set of decode ranks written to
        self.sender = Sender(self.transfer, self.meta, self.group.size, self.timeout_s, self.extras)
        # on the CPU the forward runs on the cores: a forward's writes are staged and submitted at the next poll
        self._settles = self.memory.pools.kv.buffer.device.type == "cpu"
        self._staged: list[tuple[concurrent.futures.Future, Job]] = []
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
        target[RECEIVED] = time.monotonic()
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
        refused = self._expired(req)
        try:
            writes = [self._write_of(req, dst, extras is not None) for dst in layouts]
        except Exception as error:  # the destination does not fit this rank: the write fails
            refused = error
        if refused is not None:
            writes = [self._write_of(req, dst, False, data=False) for dst in layouts]
        job = Job(
            writes,
            req.bootstrap_room,
            req.state_slot,
            token,
            req.prompt_tokens_from_cache,
            extras,
            refused,
        )
        if self._settles:
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._staged.append((future, job))
        else:
            future = self.sender.submit(job)
        self.inflight.append((req, future))
        return True

    def _expired(self, req: Req) -> Exception | None:
        """A destination older than half the timeout is not written into: the decode side gives up on its
        reservation after the timeout and frees it a while later, and a write started now might outlast that."""
        age = time.monotonic() - req.transfer_target.get(RECEIVED, time.monotonic())
        if age <= self.timeout_s / 2:
            return None
        return TimeoutError(
            f"the prefill took {age:.1f} s after the decode server's destination came, more than half the "
            f"transfer timeout ({self.timeout_s:g} s)"
        )

    def _write_of(self, req: Req, dst: PoolLayout, extras: bool, data: bool = True) -> Write:
        target = req.transfer_target
        meta = dst.meta_address(target["meta_row"], self.group.rank)
        where = dst.extras[0] + target["extras"][0] if extras else None
        if not data:
            return Write(dst.session, ([], [], []), meta, None)
        self.layout.check_matches(dst)
        n = len(req.input_ids)
        pages = self.memory.pages_of(req, n)
        blocks = request_blocks(
            self.layout, dst, pages, target["kv_pages"], n, req.state_slot, target["state_slot"]
        )
        return Write(dst.session, blocks, meta, where)

    # ---- the scheduler thread ----------------------------------------------------------------------------------
    def poll(self) -> None:
        if not (
            self.bootstrap or self.targets or self.inflight or self.unsettled or self.sender.owes
        ):
            return
        self._settle()
        self.sender.write_owed()
        local = [self._local_status(future) for _, future in self.inflight]
        local += [self._settled(underway, settle_by) for _, underway, settle_by in self.unsettled]
        self.now, statuses = self.group.agree(local)
        self._expire()
        held = list(self.unsettled)
        for (req, future), status in zip(list(self.inflight), statuses):
            if status != PENDING:
                self.inflight.remove((req, future))
                self._finish(req, future, status)
        for entry, status in zip(held, statuses[len(local) - len(held) :]):
            if status != PENDING:
                self.unsettled.remove(entry)
                self.memory.release(entry[0], cache=False)

    def _settled(self, underway: tuple[int, ...], settle_by: float | None) -> int:
        """PENDING while an unsettled write's blocks may still read the request's memory."""
        if underway and self.transfer.underway(underway):
            return PENDING
        return PENDING if settle_by is not None and time.monotonic() < settle_by else DONE

    def _settle(self) -> None:
        """On the CPU: submits the writes of the last forward's requests and waits for them (at most
        ``CPU_SETTLE_S``), so that neither the forward's threads nor this thread's Python run beside them."""
        if not self._staged:
            return
        staged, self._staged = self._staged, []
        for future, job in staged:
            self.sender.submit(job, future)
        concurrent.futures.wait([future for future, _ in staged], timeout=CPU_SETTLE_S)

    @staticmethod
    def _local_status(future: concurrent.futures.Future) -> int:
        if not future.done():
            return PENDING
        error = future.exception()
        if isinstance(error, TransferError) and not error.settled:
            return UNSETTLED
        return FAILED if error is not None else DONE

    def _finish(self, req: Req, future: concurrent.futures.Future, status: int) -> None:
        if (
            status == UNSETTLED
        ):  # every rank of the group holds the request's memory until the blocks end
            self.aborted.discard(req.rid)
            error = future.exception()
            underway = getattr(error, "underway", ())
            settle_by = getattr(error, "settle_by", None)
            self.unsettled.append((req, underway, settle_by))
            logger.error("KV transfer of %s failed with blocks still under way: %s", req.rid, error)
            message = f"KV transfer to the decode server failed: {error or 'another rank failed'}"
            self.host.end(req, self.failure(message), keep_memory=True)
        elif req.rid in self.aborted:
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

    def abort(self, req: Req, reason: FinishReason, settled: bool = False) -> bool:
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
        return bool(self.bootstrap or self.inflight or self.unsettled)

    def held(self) -> list[Req]:
        return [r for r, _ in self.inflight] + [r for r, _, _ in self.unsettled]

    def loads(self) -> dict[str, Any]:
        writing = sum(1 for _, future in self.inflight if not future.done())
        return {
            "prefill_prealloc_queue_reqs": len(self.bootstrap),
            "prefill_inflight_queue_reqs": len(self.inflight),
            **self.transfer_figures(writing),
        }

    def take_notices(self) -> list[dict[str, Any]]:
        return []
