"""The Mooncake transfer engine (``mooncake-transfer-engine-non-cuda`` on CPU machines), as SGLang uses it.

Each rank starts one engine (``P2PHANDSHAKE``: peers find each other by ``host:port``, no metadata server), over
TCP, or RDMA when ``--disaggregation-ib-device`` names a device, and registers its pool buffers once. A prefill rank
writes into a decode rank's registered memory: a request's data, the few blocks its layout coalesces it into, in one
batch (on GPU servers; polled block by block on CPU servers, see ``MooncakeTransfer.write``), then its metadata row
(a second write, which must land after the data: the engine does not order the blocks it has under way).
"""

from __future__ import annotations

import bisect
import collections
import socket
import time
from dataclasses import dataclass, field

import torch

INSTALL_HINT = (
    "PD disaggregation needs the Mooncake transfer engine: pip install mooncake-transfer-engine-non-cuda "
    "(CPU) and its system library: apt-get install libibverbs1"
)


MAX_BATCH_BLOCKS = 1024  # blocks of one write under way at once (one batch or one-block batches)
POLL_S = 0.0001  # between checks of a write's blocks
WRITE_TIMEOUT_S = 30.0  # plus a second per GB, as the engine's synchronous write
FAILED_BATCH = 2**64 - 1  # the engine's -1 as its unsigned batch id


class TransferError(RuntimeError):
    """A write to the peer failed (the engine returned an error code)."""


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

    def __init__(self, hostname: str, ib_device: str | None = None, poll: bool = False) -> None:
        self.poll = poll
        try:
            from mooncake.engine import TransferEngine
        except ImportError as error:  # the wheel, or libibverbs.so.1 it links
            raise RuntimeError(f"{INSTALL_HINT} ({error})") from error
        self.engine = TransferEngine()
        protocol = "rdma" if ib_device else "tcp"
        code = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, ib_device or "")
        if code != 0:
            raise RuntimeError(
                f"Mooncake transfer engine did not start on {hostname} over {protocol} (code {code})"
            )
        self.session_id = f"{hostname}:{self.engine.get_rpc_port()}"
        self.stats = TransferStats()

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
        returns once all have landed: the bytes written, or raises TransferError (once none is still under way).

        The engine's synchronous batch write waits by spinning on a core. Where cores are few and busy with the
        forwards (a CPU server) that spinning takes the core the engine's own TCP threads and the peer's need, and a
        ~1 ms write often took several (docs/pd.md): there (``poll``) every block goes to the engine at once, each
        as a batch of its own, and their completion is polled with short sleeps. A poll needs the GIL, though,
        which a forward's Python holds while the write overlaps it: elsewhere the synchronous write keeps the wait
        off the GIL. Either way at most ``MAX_BATCH_BLOCKS`` blocks are under way at once (the TCP transport
        refuses larger batches: seen from ~2,100 blocks)."""
        write = self._write_polled if self.poll else self._write_batches
        return write(session, sources, targets, lengths)

    def _write_polled(
        self, session: str, sources: list[int], targets: list[int], lengths: list[int]
    ) -> int:
        # the engine's own deadline: 30 s plus a second per GB
        deadline = time.monotonic() + WRITE_TIMEOUT_S + sum(lengths) / 1e9
        underway: collections.deque[tuple[int, int]] = collections.deque()
        errors: list[str] = []
        for i, (source, target, length) in enumerate(zip(sources, targets, lengths, strict=True)):
            if len(underway) == MAX_BATCH_BLOCKS:
                self._await(*underway.popleft(), deadline, errors)
            if errors:
                break  # send no more; wait for what is under way, which still reads our memory
            batch = self.engine.transfer_submit_write(session, source, target, length)
            if batch in (0, FAILED_BATCH):
                errors.append(f"block {i} was refused")
                break
            underway.append((i, batch))
        while underway:
            self._await(*underway.popleft(), deadline, errors)
        if errors:
            raise TransferError(
                f"Mooncake write of {len(sources)} blocks to {session} failed: {'; '.join(errors[:3])}"
            )
        return sum(lengths)

    def _write_batches(
        self, session: str, sources: list[int], targets: list[int], lengths: list[int]
    ) -> int:
        for i in range(0, len(sources), MAX_BATCH_BLOCKS):
            batch = slice(i, i + MAX_BATCH_BLOCKS)
            code = self.engine.batch_transfer_sync_write(
                session, sources[batch], targets[batch], lengths[batch]
            )
            if code != 0:
                raise TransferError(
                    f"Mooncake write of blocks {i}-{i + len(sources[batch]) - 1} of {len(sources)} "
                    f"to {session} failed (code {code})"
                )
        return sum(lengths)

    def _await(self, block: int, batch: int, deadline: float, errors: list[str]) -> None:
        """Polls the one-block ``batch`` until it ends (the engine frees it then) or ``deadline`` passes."""
        while (code := self.engine.transfer_check_status(batch)) == 0:
            if time.monotonic() > deadline:
                # the engine keeps the batch: leaked, never reused
                errors.append(f"block {block} timed out")
                return
            time.sleep(POLL_S)
        if code != 1:
            errors.append(f"block {block} failed (code {code})")
