"""Which errors a rank survives: a request's own failure ends that request, a step's failure ends its batch, and
only a broken process (a CUDA error, out-of-memory that repeats, a failed collective) ends the rank.

CUDA reports a poisoned context (an illegal address, a device-side assert) as a RuntimeError whose message names
it; every later kernel fails the same way, so the process is beyond repair. Out-of-memory can pass (the next batch
may be smaller), so it is fatal only when ``MAX_MEMORY_FAILURES`` steps in a row fail with it.
"""

from __future__ import annotations

import torch

from sglang_lite.distributed import CollectiveError

MAX_MEMORY_FAILURES = 3
_BROKEN_DEVICE = (
    "CUDA error",
    "CUBLAS_STATUS",
    "CUDNN_STATUS",
    "device-side assert",
    "illegal memory access",
    "NCCL error",
    "HIP error",
)


class RankBroken(RuntimeError):
    """The process cannot go on: the rank must exit (and be restarted by its supervisor)."""


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, (MemoryError, torch.cuda.OutOfMemoryError))


def breaks_the_device(error: BaseException) -> bool:
    """A device error after which no kernel runs correctly in this process, or a failed collective (a peer of the
    world is dead or hung: the world cannot go on)."""
    if isinstance(error, CollectiveError):
        return True
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return False
    return isinstance(error, RuntimeError) and any(mark in str(error) for mark in _BROKEN_DEVICE)


def describe(error: BaseException) -> str:
    """The message a failed request carries."""
    return f"internal error: {type(error).__name__}: {error}"


class MemoryFailures:
    """Counts steps in a row that ran out of memory; too many in a row means the rank cannot recover."""

    def __init__(self, limit: int = MAX_MEMORY_FAILURES) -> None:
        self.limit, self.in_a_row = limit, 0

    def on_step_ok(self) -> None:
        self.in_a_row = 0

    def on_out_of_memory(self, error: BaseException) -> None:
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            raise RankBroken(
                f"{self.in_a_row} steps in a row ran out of memory: {error}"
            ) from error
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
