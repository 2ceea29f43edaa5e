"""Waiting for a server process to answer: shared by tests and benchmarks that start servers."""
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
