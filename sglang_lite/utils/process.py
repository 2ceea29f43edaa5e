"""Processes: waiting for a server to answer (tests, benchmarks), stopping scheduler processes, heap settings."""

from __future__ import annotations

import ctypes
import subprocess
import time


def wait_until_healthy(
    url: str,
    process: subprocess.Popen,
    timeout_s: float,
    path: str = "/health",
    interval_s: float = 0.5,
) -> bool:
    """Polls ``GET url + path`` until it answers 200 (True); False once ``process`` has exited or time is up.

    The caller raises its own error (with the process's log) on False.
    """
    import httpx  # only the callers that poll servers pay for it, not every scheduler process importing this module

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    return False


def stop_processes(processes: list[subprocess.Popen], grace_s: float = 3.0) -> None:
    """Waits briefly for processes told to stop, then terminates, then kills what is left."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        _wait(process, deadline - time.monotonic())
    for process in processes:
        for stop in (process.terminate, process.kill):
            if process.poll() is None:
                stop()
                _wait(process, 1.0)


def _wait(process: subprocess.Popen, timeout_s: float) -> None:
    try:
        process.wait(max(timeout_s, 0.0))
    except subprocess.TimeoutExpired:
        pass


def keep_freed_heap_memory() -> None:
    """glibc only: serve large blocks from the heap and keep what is freed there. By default each block over 128 KiB
    (the threshold adapts up to 32 MiB) is a fresh mmap whose pages fault in on first touch, and the heap top is
    trimmed back to the OS, so every step of a CPU forward page-faults on its temporaries; this removes most of those
    faults (the effect on the offline benchmark: docs/performance.md). The process keeps its peak heap in return.
    Scheduler processes call it at start; the CPU benchmarks call it so both sides of a comparison run alike."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold = -1
    m_top_pad = -2
    m_mmap_threshold = -3
    libc.mallopt(m_mmap_threshold, 32 * 2**20)  # the largest glibc accepts
    libc.mallopt(m_trim_threshold, 2**30)
    libc.mallopt(m_top_pad, 64 * 2**20)
