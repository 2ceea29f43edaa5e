"""Timing helpers shared by the kernel benchmark cases: median of many runs, CUDA events on a GPU."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def time_ms(
    fn: Callable[[], object], device: torch.device, iters: int = 50, warmup: int = 5
) -> float:
    """Median wall time of ``fn()`` in milliseconds (events on CUDA/ROCm, perf_counter on the CPU)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        return _time_cuda(fn, iters)
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _time_cuda(fn: Callable[[], object], iters: int) -> float:
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)
