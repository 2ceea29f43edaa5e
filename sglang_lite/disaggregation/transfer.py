"""The Mooncake transfer engine (``mooncake-transfer-engine-non-cuda`` on CPU machines), as SGLang uses it.

Each rank starts one engine (``P2PHANDSHAKE``: peers find each other by ``host:port``, no metadata server), over
TCP, or RDMA when ``--disaggregation-ib-device`` names a device, and registers its pool buffers once. A prefill rank
writes into a decode rank's registered memory with batched synchronous writes.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch

INSTALL_HINT = (
    "PD disaggregation needs the Mooncake transfer engine: pip install mooncake-transfer-engine-non-cuda "
    "(CPU) and its system library: apt-get install libibverbs1"
)


MAX_BATCH_BLOCKS = 1024  # blocks per batched write


class TransferError(RuntimeError):
    """A write to the peer failed (the engine returned an error code)."""


def local_hostname(host: str) -> str:
    """The address peers reach this machine at: the bind host, unless it is a wildcard."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


@dataclass
class TransferStats:
    """Bytes and seconds of the completed transfers, and the last one's figures."""

    transfers: int = 0
    bytes: int = 0
    seconds: float = 0.0
    last_latency_ms: float = 0.0
    last_speed_gb_s: float = 0.0

    def record(self, nbytes: int, seconds: float) -> None:
        self.transfers += 1
        self.bytes += nbytes
        self.seconds += seconds
        self.last_latency_ms = seconds * 1e3
        self.last_speed_gb_s = nbytes / max(seconds, 1e-9) / 1e9


class MooncakeTransfer:
    def __init__(self, hostname: str, ib_device: str | None = None) -> None:
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
        self,
        session: str,
        sources: list[int],
        targets: list[int],
        lengths: list[int],
    ) -> int:
        """Writes each ``lengths[i]`` bytes at local ``sources[i]`` to ``targets[i]`` of the peer ``session``, in
        batches of at most ``MAX_BATCH_BLOCKS`` (the TCP transport refuses larger ones: seen from ~2,100);
        returns the bytes written or raises TransferError. The caller records whole transfers in ``stats``."""
        if not sources:
            return 0
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
