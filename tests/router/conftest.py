"""Process fixtures for the router tests: every server binds 127.0.0.1 on a free port and is always killed.

To run the end-to-end tests against real sglang_lite servers, change `upstream_command` (one line).
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def upstream_command(port: int, dp_size: int, token_delay: float, name: str) -> list[str]:
    return [sys.executable, str(HERE / "upstream.py"), "--port", str(port), "--dp-size", str(dp_size),
            "--token-delay", str(token_delay), "--name", name]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    popen: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (the server and anything it spawned), then reap it."""
        if self.alive():
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=5)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def launch(cmd: list[str], ready: re.Pattern, timeout: float = 20.0) -> Proc:
    """Start `cmd` in its own process group with output to a file (a pipe could fill and block it); wait for
    the `ready` line, whose first group is the bound port."""
    log = Path(tempfile.mkstemp(prefix="router-test-", suffix=".log")[1])
    with open(log, "wb") as out:
        popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
    proc = Proc(popen, 0, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = ready.search(proc.output())
        if match:
            proc.port = int(match.group(1))
            return proc
        if not proc.alive():
            break
        time.sleep(0.02)
    text = proc.output()
    proc.kill()
    raise RuntimeError(f"{cmd} did not become ready:\n{text[-3000:]}")


def start_upstream(dp_size: int = 1, token_delay: float = 0.0, port: int = 0, name: str = "upstream") -> Proc:
    return launch(upstream_command(port, dp_size, token_delay, name), re.compile(r"READY port=(\d+)"))


def start_router(*args: str) -> Proc:
    cmd = [sys.executable, "-m", "sglang_lite.router", "--port", "0", "--log-level", "info", *args]
    return launch(cmd, re.compile(r"router listening on http://127\.0\.0\.1:(\d+)"))


class Procs:
    """Starts processes and kills every one of them at teardown, whatever happened in the test."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []

    def upstream(self, **kwargs) -> Proc:
        proc = start_upstream(**kwargs)
        self.procs.append(proc)
        return proc

    def router(self, *args: str) -> Proc:
        proc = start_router(*args)
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.log.unlink(missing_ok=True)


@pytest.fixture
def procs(request):
    group = Procs()
    try:
        yield group
    finally:
        if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
            for proc in group.procs:  # the servers' logs explain most failures
                sys.stderr.write(f"\n--- {proc.popen.args[:3]} log ---\n{proc.output()[-4000:]}")
        group.kill_all()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
