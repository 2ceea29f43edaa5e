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
import time
from dataclasses import dataclass
from typing import Any

import torch

from sglang_lite.disaggregation.extras import ExtrasArea, extras_size
from sglang_lite.disaggregation.extras import encode as encode_extras
from sglang_lite.disaggregation.layout import MAX_SOURCES, Meta, PoolLayout, request_blocks
from sglang_lite.scheduler.disagg.base import DONE, FAILED, PENDING, TransferSide
from sglang_lite.scheduler.request import FinishReason, Req, ReqStatus

logger = logging.getLogger(__name__)
STATUS_RETRIES = 5


@dataclass(frozen=True)
class _Job:
    """One request's transfer, as the scheduler thread hands it to the transfer thread."""

    target: dict[str, Any]
    slots: list[int]  # the request's KV slots here, one per prompt position
    state_slot: int
    token: int
    cached: int  # prompt tokens the prefix cache served
    extras: torch.Tensor | None  # the log-probabilities' bytes (the group's first rank sends them)


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
        decoding here (not for a re-prefill after a retraction, which has no room)."""
        if req.bootstrap_room is None:
            return False
        req.status = ReqStatus.TRANSFERRING
        prompt_len = len(req.input_ids)
        sends_extras = self.group.rank == 0 and extras_size(req.logprob, prompt_len)
        job = _Job(
            req.transfer_target,
            self.memory.slots_of(req, prompt_len),
            req.state_slot,
            token,
            req.prompt_tokens_from_cache,
            # taken now: the request's own output takes the entries later
            encode_extras(req.logprob_record.entries, req.logprob, prompt_len)
            if sends_extras
            else None,
        )
        self.inflight.append((req, self._executor.submit(self._send, job)))
        return True

    # ---- the transfer thread -----------------------------------------------------------------------------------
    def _send(self, job: _Job) -> int:
        """The data into every decode rank of the group, then this rank's metadata sub-row in each; returns the
        first token."""
        layouts = [PoolLayout.from_dict(d) for d in job.target["layouts"]]
        try:
            start = time.perf_counter()
            sent = [self._write_data(job, dst) for dst in layouts]
            nanos = int((time.perf_counter() - start) * 1e9)
        except Exception:
            for dst in layouts:
                self._write_meta(job, dst, FAILED, 0, 0, retries=STATUS_RETRIES)
            raise
        self.transfer.stats.record(sum(sent), nanos / 1e9)
        for dst, nbytes in zip(layouts, sent):
            self._write_meta(job, dst, DONE, nbytes, nanos)
        return job.token

    def _write_data(self, job: _Job, dst: PoolLayout) -> int:
        self.layout.check_matches(dst)
        target = job.target
        sources, targets, lengths = request_blocks(
            self.layout, dst, job.slots, target["kv_slots"], job.state_slot, target["state_slot"]
        )
        if job.extras is not None:
            offset, size = target["extras"]
            assert job.extras.numel() == size, (
                "the two sides size the log-probabilities differently"
            )
            local = self._stage(job.extras)
            sources.append(local)
            targets.append(dst.extras[0] + offset)
            lengths.append(size)
        return self.transfer.write(dst.session, sources, targets, lengths)

    def _stage(self, data: torch.Tensor) -> int:
        """``data`` in this rank's registered extras area (one transfer at a time uses it); its address."""
        if data.numel() > self.extras.size:
            self.transfer.unregister(self.extras.buffer)
            self.extras = ExtrasArea(2 * data.numel())
            self.transfer.register([self.extras.buffer])
        self.extras.buffer[: data.numel()] = data
        return self.extras.buffer.data_ptr()

    def _write_meta(
        self, job: _Job, dst: PoolLayout, status: int, nbytes: int, nanos: int, retries: int = 1
    ) -> None:
        row = self.meta[job.state_slot, 0]  # staging: this rank's sub-row as written there
        row.zero_()
        values = {
            Meta.TOKEN: job.token,
            Meta.BYTES: nbytes,
            Meta.NANOS: nanos,
            Meta.SOURCES: self.group.size,
            Meta.CACHED: job.cached,
            Meta.STATUS: status,
        }
        for field, value in values.items():
            row[field] = value
        address = dst.meta_address(job.target["meta_row"], self.group.rank)
        for attempt in range(retries):  # a write right after a failed batch can fail too: try again
            try:
                self.transfer.write(dst.session, [row.data_ptr()], [address], [row.numel() * 8])
                return
            except Exception:
                if attempt + 1 == retries:
                    raise
                time.sleep(0.05 * (attempt + 1))  # the decode side times out if every try fails

    # ---- the scheduler thread ----------------------------------------------------------------------------------
    def poll(self) -> None:
        if not (self.bootstrap or self.targets or self.inflight):
            return
        local = [self._local_status(future) for _, future in self.inflight]
        self.now, statuses = self.group.agree(local)
        self._expire()
        for (req, future), status in zip(list(self.inflight), statuses):
            if status != PENDING:
                self.inflight.remove((req, future))
                self._finish(req, future, status)

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
            self.host.finish_transferred(req, future.result())

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
        return {
            "prefill_prealloc_queue_reqs": len(self.bootstrap),
            "prefill_inflight_queue_reqs": len(self.inflight),
            **self.transfer_figures(),
        }

    def take_notices(self) -> list[dict[str, Any]]:
        return []
