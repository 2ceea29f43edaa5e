"""Pool slots of a batch, as the CPU references read and write them."""

from __future__ import annotations

import torch


def slot_run(slots: torch.Tensor, pool: torch.Tensor) -> slice | None:
    """``slots`` as a slice of ``pool`` when they are consecutive and ascending (a batch admitted together usually
    is): a decode step then updates the pool's rows in place instead of gathering them and scattering them back,
    two copies of the largest tensors of the step. None otherwise, for a non-fp32 pool (computed in fp32 apart),
    off the CPU, and while torch.compile traces (it fuses the gather and the scatter itself, and a host read
    would split its graph)."""
    if pool.dtype != torch.float32 or slots.device.type != "cpu" or not slots.numel():
        return None
    if torch.compiler.is_compiling():
        return None
    first, count = int(slots[0]), slots.numel()
    if not torch.equal(slots, torch.arange(first, first + count, dtype=slots.dtype)):
        return None
    return slice(first, first + count)
