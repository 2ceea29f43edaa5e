"""The Mooncake transfer engine (``mooncake-transfer-engine-non-cuda`` on CPU machines), as SGLang uses it.

Each rank starts one engine (``P2PHANDSHAKE``: peers find each other by ``host:port``, no metadata server), over
TCP, or RDMA when ``--disaggregation-ib-device`` names a device, and registers its pool buffers once. A prefill rank
writes into a decode rank's registered memory: a request's data, the few blocks its layout coalesces it into, in one
batch (on GPU servers; polled block by block on CPU servers, see ``MooncakeTransfer.write``), then its metadata row
(a second write, which must land after the data: the engine does not order the blocks it has under way).

A write fails *settled* (``TransferError.settled``) only once none of its blocks can still land: the decode side
frees the pages of a request that failed so, and a block the engine has not ended is waited for, never given up on
(one that outlives twice its deadline makes the failure unsettled, and its request's pages stay held on both sides).
A peer that fails a write (a block timed out, or one failed and the peer does not answer a probe) is marked down:
writes to it fail at once, without the engine's reconnect back-off (1, 2, 4, ... seconds a write), until it answers
a probe.
"""

from __future__ import annotations

import bisect
import collections
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

INSTALL_HINT = (
    "PD disaggregation needs the Mooncake transfer engine: pip install mooncake-transfer-engine-non-cuda "
    "(CPU) and its system library: apt-get install libibverbs1"
)


MAX_BATCH_BLOCKS = 1024  # blocks of one write under way at once (one batch or one-block batches)
POLL_S = 0.0001  # between checks of a write's blocks
WRITE_TIMEOUT_S = 30.0  # plus a second per GB, as the engine's synchronous write
FAILED_BATCH = 2**64 - 1  # the engine's -1 as its unsigned batch id
# a one-block batch's status: 0 under way, 1 completed, -1 failed (both free the batch), -2 timed out by the
# engine (which keeps the batch: the block may still be under way)
ENDED = (1, -1)
PROBE_INTERVAL_S = 2.0  # a peer marked down is probed again at most this often
# the engine's own deadline of a synchronous write (its MC_TRANSFER_TIMEOUT, at least 5 s; 30 s by default), past
# which it returns -1 with blocks still under way
ENGINE_SYNC_TIMEOUT_S = max(5, int(os.environ.get("MC_TRANSFER_TIMEOUT", "30") or 30))


class TransferError(RuntimeError):
    """A write to the peer failed. ``settled``: every block of it has ended, none can still land in the peer's
    memory nor read ours; else ``underway`` lists the engine's batches not ended yet (``MooncakeTransfer.underway``
    tells when they have), and ``settle_by`` is when the write's memory may be reused all the same, for blocks the
    engine gives no way to follow (a synchronous write's)."""

    def __init__(
        self,
        message: str,
        settled: bool = True,
        underway: tuple[int, ...] = (),
        settle_by: float | None = None,
        timed_out: bool = False,
    ) -> None:
        super().__init__(message)
        self.settled = settled
        self.timed_out = (
            timed_out  # a block outlived the deadline: the peer is stopped, dead or swamped
        )
        self.underway = underway
        self.settle_by = settle_by


class PeerDown(TransferError):
    """Refused without writing: the peer failed an earlier write and has not answered a probe since."""


def local_hostname(host: str) -> str:
    """The address peers reach this machine at: the bind host, unless it is a wildcard."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


# Prometheus buckets of one request's transfer: its time (seconds) and its size (bytes)
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0, 5.0)
SIZE_BUCKETS_BYTES = (2**16, 2**18, 2**20, 2**22, 2**24, 2**26, 2**28, 2**30)
RECENT_TRANSFERS = 32  # the moving averages' window


def bucket_counts(bounds: tuple[float, ...]) -> list[int]:
    return [0] * (len(bounds) + 1)  # the last is +Inf


@dataclass
class TransferStats:
    """The completed transfers of one rank (one per request): totals, moving averages over the last
    ``RECENT_TRANSFERS``, and histograms of their time and size."""

    transfers: int = 0
    bytes: int = 0
    seconds: float = 0.0
    recent: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=RECENT_TRANSFERS)
    )
    latency_counts: list[int] = field(default_factory=lambda: bucket_counts(LATENCY_BUCKETS_S))
    size_counts: list[int] = field(default_factory=lambda: bucket_counts(SIZE_BUCKETS_BYTES))

    def record(self, nbytes: int, seconds: float) -> None:
        self.transfers += 1
        self.bytes += nbytes
        self.seconds += seconds
        self.recent.append((nbytes, seconds))
        self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        self.size_counts[bisect.bisect_left(SIZE_BUCKETS_BYTES, nbytes)] += 1

    @property
    def latency_ms(self) -> float:
        """Mean time of the recent transfers."""
        return sum(s for _, s in self.recent) / len(self.recent) * 1e3 if self.recent else 0.0

    @property
    def speed_gb_s(self) -> float:
        """Bytes over seconds of the recent transfers taken together."""
        seconds = sum(s for _, s in self.recent)
        return sum(n for n, _ in self.recent) / seconds / 1e9 if seconds > 0 else 0.0


class MooncakeTransfer:
    """One rank's engine. ``poll``: a write waits for its blocks by polling with short sleeps, not with the engine's
    synchronous wait, which spins on a core (for CPU servers, whose cores run the forwards; see ``write``)."""

    def __init__(
        self, engine: Any, session_id: str, poll: bool, write_timeout_s: float = WRITE_TIMEOUT_S
    ) -> None:
        self.engine = engine
        self.session_id = session_id
        self.poll = poll
        self.write_timeout_s = write_timeout_s
        self.stats = TransferStats()
        self._down: dict[str, float] = {}  # peer session -> when it last failed a write or a probe
        self._lock = threading.Lock()  # writes to several peers run on threads of their own

    @classmethod
    def start(
        cls,
        hostname: str,
        ib_device: str | None = None,
        poll: bool = False,
        write_timeout_s: float = WRITE_TIMEOUT_S,
    ) -> MooncakeTransfer:
        """Starts this rank's engine on ``hostname`` (TCP, or RDMA on ``ib_device``)."""
        try:
            from mooncake.engine import TransferEngine
        except ImportError as error:  # the wheel, or libibverbs.so.1 it links
            raise RuntimeError(f"{INSTALL_HINT} ({error})") from error
        engine = TransferEngine()
        protocol = "rdma" if ib_device else "tcp"
        code = engine.initialize(hostname, "P2PHANDSHAKE", protocol, ib_device or "")
        if code != 0:
            raise RuntimeError(
                f"Mooncake transfer engine did not start on {hostname} over {protocol} (code {code})"
            )
        return cls(engine, f"{hostname}:{engine.get_rpc_port()}", poll, write_timeout_s)

    def register(self, tensors: list[torch.Tensor]) -> None:
        """Registers each tensor's memory once (the pools are allocated up front and never move)."""
        for tensor in tensors:
            if not tensor.numel():
                continue
            code = self.engine.register_memory(
                tensor.data_ptr(), tensor.numel() * tensor.element_size()
            )
            if code != 0:
                raise RuntimeError(
                    f"Mooncake could not register a buffer of {tuple(tensor.shape)} (code {code})"
                )

    def unregister(self, tensor: torch.Tensor) -> None:
        self.engine.unregister_memory(tensor.data_ptr())

    def write(
        self, session: str, sources: list[int], targets: list[int], lengths: list[int]
    ) -> int:
        """Writes each ``lengths[i]`` bytes at local ``sources[i]`` to ``targets[i]`` of the peer ``session`` and
        returns once all have landed: the bytes written, or raises TransferError (settled, unless a block outlived
        twice the write's deadline), or PeerDown at once for a peer marked down.

        The engine's synchronous batch write waits by spinning on a core. Where cores are few and busy with the
        forwards (a CPU server) that spinning takes the core the engine's own TCP threads and the peer's need, and a
        ~1 ms write often took several (docs/pd.md): there (``poll``) every block goes to the engine at once, each
        as a batch of its own, and their completion is polled with short sleeps. A poll needs the GIL, though,
        which a forward's Python holds while the write overlaps it: elsewhere the synchronous write keeps the wait
        off the GIL. Either way at most ``MAX_BATCH_BLOCKS`` blocks are under way at once (the TCP transport
        refuses larger batches: seen from ~2,100 blocks)."""
        self._check_up(session)
        write = self._write_polled if self.poll else self._write_batches
        try:
            return write(session, sources, targets, lengths)
        except TransferError as error:
            # a block the peer refused (a bad address) is no sign of a dead peer: one that answers a probe is not
            # marked down (a dead one refuses it at once)
            if error.timed_out or self.engine.send_probe(session) != 0:
                self._mark_down(session)
            raise

    def underway(self, batches: tuple[int, ...]) -> tuple[int, ...]:
        """Those of an unsettled write's ``batches`` that the engine has not ended yet."""
        return tuple(b for b in batches if self.engine.transfer_check_status(b) not in ENDED)

    def is_down(self, session: str) -> bool:
        with self._lock:
            return session in self._down

    def _check_up(self, session: str) -> None:
        """Raises PeerDown for a peer marked down, unless it answers a probe (sent at most every
        ``PROBE_INTERVAL_S``; a stopped peer may keep it waiting, which only this peer's writes wait for)."""
        with self._lock:
            since = self._down.get(session)
        if since is None:
            return
        if time.monotonic() - since >= PROBE_INTERVAL_S and self.engine.send_probe(session) == 0:
            with self._lock:
                self._down.pop(session, None)
            return
        self._mark_down(session)
        raise PeerDown(f"Mooncake peer {session} is down (it failed a write and a probe since)")

    def _mark_down(self, session: str) -> None:
        with self._lock:
            self._down[session] = time.monotonic()

    def _write_polled(
        self, session: str, sources: list[int], targets: list[int], lengths: list[int]
    ) -> int:
        # the engine's own deadline: the write timeout plus a second per GB; blocks still under way then are
        # waited for as long again, so that the failure is settled
        budget = self.write_timeout_s + sum(lengths) / 1e9
        deadline = time.monotonic() + budget
        settle_by = deadline + budget
        underway: collections.deque[tuple[int, int]] = collections.deque()
        errors: list[str] = []
        unended: list[int] = []
        for i, (source, target, length) in enumerate(zip(sources, targets, lengths, strict=True)):
            if len(underway) == MAX_BATCH_BLOCKS:
                self._await(*underway.popleft(), deadline, settle_by, errors, unended)
            if errors:
                break  # send no more; wait for what is under way, which still reads our memory
            batch = self.engine.transfer_submit_write(session, source, target, length)
            if batch in (0, FAILED_BATCH):
                errors.append(f"block {i} was refused")
                break
            underway.append((i, batch))
        while underway:
            self._await(*underway.popleft(), deadline, settle_by, errors, unended)
        if errors:
            message = f"Mooncake write of {len(sources)} blocks to {session} failed: {'; '.join(errors[:3])}"
            if unended:
                message += f" ({len(unended)} blocks still under way after {2 * budget:g} s)"
            timed_out = any("timed out" in e for e in errors)
            raise TransferError(
                message, settled=not unended, underway=tuple(unended), timed_out=timed_out
            )
        return sum(lengths)

    def _write_batches(
        self, session: str, sources: list[int], targets: list[int], lengths: list[int]
    ) -> int:
        for i in range(0, len(sources), MAX_BATCH_BLOCKS):
            batch = slice(i, i + MAX_BATCH_BLOCKS)
            start = time.monotonic()
            code = self.engine.batch_transfer_sync_write(
                session, sources[batch], targets[batch], lengths[batch]
            )
            if code != 0:
                # past the engine's own deadline it gives up on blocks still under way, and frees their batch:
                # they cannot be followed, so the failure holds the memory for as long again
                seconds = time.monotonic() - start
                timed_out = seconds >= ENGINE_SYNC_TIMEOUT_S
                raise TransferError(
                    f"Mooncake write of blocks {i}-{i + len(sources[batch]) - 1} of {len(sources)} "
                    f"to {session} failed (code {code}, after {seconds:.1f} s)",
                    settled=not timed_out,
                    settle_by=time.monotonic() + seconds if timed_out else None,
                    timed_out=timed_out,
                )
        return sum(lengths)

    def _await(
        self,
        block: int,
        batch: int,
        deadline: float,
        settle_by: float,
        errors: list[str],
        unended: list[int],
    ) -> None:
        """Polls the one-block ``batch`` until it ends (the engine frees it then). Past ``deadline`` the write has
        timed out, but the block may still land: it is polled on until ``settle_by``, then left in ``unended``."""
        timed_out = False
        while (code := self.engine.transfer_check_status(batch)) not in ENDED:
            now = time.monotonic()
            if now > deadline and not timed_out:
                timed_out = True
                errors.append(f"block {block} timed out")
            if now > settle_by:
                unended.append(batch)
                return
            time.sleep(POLL_S)
        if code != 1 and not timed_out:
            errors.append(f"block {block} failed (code {code})")
