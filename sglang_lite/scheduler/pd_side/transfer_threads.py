"""PD prefill side's transfer threads: a request's transfer (a ``Job``, worked out on the scheduler's thread) goes
into every decode rank of its destination, data first, then this rank's metadata sub-row in each.

A thread per set of decode ranks written to, so that a slow or dead peer holds up its own writes only. A failure is
written as FAILED only where none of the request's blocks may still land (``transfer.py``); a peer marked down
refuses that status too, which is then owed: written again, from a row of its own, once the peer answers a probe,
so that the decode side frees the reservation at once rather than after its timeout."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any, NamedTuple

import torch

from sglang_lite.pd_transport.extras import ExtrasArea
from sglang_lite.pd_transport.layout import META_FIELDS, Blocks, Meta
from sglang_lite.pd_transport.transfer import (
    PROBE_INTERVAL_S,
    MooncakeTransfer,
    PeerDown,
    TransferError,
)
from sglang_lite.scheduler.pd_side.base import DONE, FAILED

logger = logging.getLogger(__name__)
STATUS_RETRIES = 5
LATE_ROWS = 64  # owed statuses written at once


class Write(NamedTuple):
    """One decode rank's share of a request's transfer."""

    session: str
    blocks: Blocks
    meta: int  # the address of this rank's metadata sub-row there
    extras: int | None  # where the log-probabilities go there (the group's first rank sends them)


class Job(NamedTuple):
    """One request's transfer, worked out on the scheduler's thread."""

    writes: list[Write]
    room: int  # written into each metadata sub-row: the decode side reads only its own request's
    slot: int  # the request's state slot: its staging metadata row here
    token: int
    cached: int  # prompt tokens the prefix cache served
    extras: torch.Tensor | None  # the log-probabilities' bytes
    refused: (
        Exception | None
    )  # the destination does not fit this rank, or came too long ago: FAILED only


class Sender:
    """Runs jobs on the transfer threads. ``meta``: the rank's registered metadata rows (row 0 of a request's slot
    stages its sub-row); ``sources``: the prefill ranks of the attention group (each writes its own sub-row)."""

    def __init__(
        self,
        transfer: MooncakeTransfer,
        meta: torch.Tensor,
        sources: int,
        timeout_s: float,
        extras: ExtrasArea,
    ) -> None:
        self.transfer = transfer
        self.meta = meta
        self._meta_rows = meta.numpy()  # the same memory, written without torch's dispatch
        self.sources = sources
        self.timeout_s = timeout_s
        # where each thread stages log-probabilities (registered; the first takes the side's own area)
        self._areas: dict[tuple[str, ...], ExtrasArea] = {}
        self._spare: ExtrasArea | None = extras
        self._executors: dict[tuple[str, ...], concurrent.futures.ThreadPoolExecutor] = {}
        self._owed: list[tuple[Job, Write, float]] = []  # (job, write, since)
        self._lock = threading.Lock()
        self._owed_tried = 0.0
        self._late = torch.zeros(LATE_ROWS, META_FIELDS, dtype=torch.int64)  # owed ones' rows
        self._late_rows = self._late.numpy()
        self._late_free = list(range(LATE_ROWS))
        transfer.register([self._late])

    @property
    def owes(self) -> bool:
        return bool(self._owed)

    def submit(self, job: Job, future: concurrent.futures.Future | None = None) -> Any:
        """Sends ``job`` on its peers' thread: a new future, or the result into ``future``."""
        executor = self._executor_of(job)
        if future is None:
            return executor.submit(self.send, job)
        executor.submit(self._send_into, future, job)
        return future

    def write_owed(self) -> None:
        """Tries the owed FAILED statuses again (each peer's on its own thread, where the write probes it), at
        most every ``PROBE_INTERVAL_S``; one owed longer than the timeout is dropped (the decode side has given up
        on that reservation)."""
        now = time.monotonic()
        if not self._owed or now - self._owed_tried < PROBE_INTERVAL_S:
            return
        self._owed_tried = now
        with self._lock:
            owed, self._owed = self._owed, []
        for job, write, since in owed:
            if now - since < self.timeout_s:
                self._executor_of(job).submit(self._write_owed, job, write, since)

    def _executor_of(self, job: Job) -> concurrent.futures.ThreadPoolExecutor:
        peers = _peers(job)
        executor = self._executors.get(peers)
        if executor is None:
            executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-transfer")
            self._executors[peers] = executor
        return executor

    # ---- on the transfer threads -------------------------------------------------------------------------------
    def _send_into(self, future: concurrent.futures.Future, job: Job) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(self.send(job))
        except Exception as error:
            future.set_exception(error)

    def send(self, job: Job) -> tuple[int, int, float]:
        """The data into every decode rank of the group, then this rank's metadata sub-row in each; returns the
        first token, and the bytes and seconds of the data. A failure is written as FAILED into every decode rank
        none of whose blocks may still land; one whose may keeps PENDING (it times out, and holds its memory)."""
        sent: list[int] = []
        try:
            if job.refused is not None:
                raise job.refused
            start = time.perf_counter()
            for write in job.writes:
                sent.append(self._write_data(job, write))
            seconds = time.perf_counter() - start
        except Exception as error:
            unsettled = isinstance(error, TransferError) and not error.settled
            for i, write in enumerate(job.writes):
                if not (unsettled and i == len(sent)):
                    self._write_meta(job, write, (FAILED, 0, 0), retries=STATUS_RETRIES)
            raise
        for write, nbytes in zip(job.writes, sent):
            self._write_meta(job, write, (DONE, nbytes, int(seconds * 1e9)))
        return job.token, sum(sent), seconds

    def _write_data(self, job: Job, write: Write) -> int:
        sources, targets, lengths = (list(x) for x in write.blocks)
        if write.extras is not None:
            sources.append(self._stage(job))
            targets.append(write.extras)
            lengths.append(job.extras.numel())
        return self.transfer.write(write.session, sources, targets, lengths)

    def _stage(self, job: Job) -> int:
        """The job's log-probabilities in its thread's registered extras area (one job at a time uses it); their
        address."""
        data, peers = job.extras, _peers(job)
        with self._lock:
            area = self._areas.get(peers)
            if area is None:
                area, self._spare = self._spare, None
        if area is None or data.numel() > area.size:
            if area is not None:
                self.transfer.unregister(area.buffer)
            area = ExtrasArea(max(2 * data.numel(), 1 << 20))
            self.transfer.register([area.buffer])
        with self._lock:
            self._areas[peers] = area
        area.buffer[: data.numel()] = data
        return area.buffer.data_ptr()

    def _write_meta(
        self, job: Job, write: Write, outcome: tuple[int, int, int], retries: int = 1
    ) -> None:
        """This rank's sub-row (staged in its own row 0 of the request's slot) into the decode rank's. A FAILED
        one that a peer marked down refuses is owed."""
        self._fill(self._meta_rows[job.slot, 0], job, outcome)
        source = self.meta[job.slot, 0].data_ptr()
        for attempt in range(retries):  # a write right after a failed batch can fail too: try again
            try:
                self.transfer.write(write.session, [source], [write.meta], [META_FIELDS * 8])
                return
            except PeerDown:
                if outcome[0] == DONE:
                    raise
                with self._lock:
                    self._owed.append((job, write, time.monotonic()))
                return
            except Exception:
                if attempt + 1 == retries:
                    raise
                time.sleep(0.05 * (attempt + 1))  # the decode side times out if every try fails

    def _fill(self, row: Any, job: Job, outcome: tuple[int, int, int]) -> None:
        status, nbytes, nanos = outcome
        row[:] = 0
        row[[Meta.TOKEN, Meta.BYTES, Meta.NANOS]] = (job.token, nbytes, nanos)
        row[[Meta.SOURCES, Meta.CACHED, Meta.ROOM, Meta.STATUS]] = (
            self.sources,
            job.cached,
            job.room,
            status,
        )

    def _write_owed(self, job: Job, write: Write, since: float) -> None:
        """An owed FAILED status, staged in a row of its own (the request's slot may be another's by now)."""
        with self._lock:
            index = self._late_free.pop() if self._late_free else None
        if index is None:
            return  # too many owed at once: the decode side frees on its own deadline
        try:
            self._fill(self._late_rows[index], job, (FAILED, 0, 0))
            source = self._late[index].data_ptr()
            self.transfer.write(write.session, [source], [write.meta], [META_FIELDS * 8])
        except PeerDown:
            with self._lock:
                self._owed.append((job, write, since))
        except Exception as error:  # the decode side frees on its own deadline
            logger.warning("an owed FAILED status for %s was lost: %s", write.session, error)
        finally:
            with self._lock:
                self._late_free.append(index)


def _peers(job: Job) -> tuple[str, ...]:
    """The decode ranks a job writes into: the key of its thread."""
    return tuple(sorted({write.session for write in job.writes}))
