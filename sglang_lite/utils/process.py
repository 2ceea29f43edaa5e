"""Child processes: waiting for a server to answer (tests, benchmarks) and stopping scheduler processes."""
from __future__ import annotations

import subprocess
import time

import httpx


def wait_until_healthy(
    url: str, process: subprocess.Popen, timeout_s: float, path: str = "/health", interval_s: float = 0.5
) -> bool:
    """Polls ``GET url + path`` until it answers 200 (True); False once ``process`` has exited or time is up.

    The caller raises its own error (with the process's log) on False.
    """
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
