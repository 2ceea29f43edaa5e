"""Process fixtures for the router tests: every server binds 127.0.0.1 on a free port and is always killed.

The end-to-end tests run against real sglang_lite servers (`python -m sglang_lite.launch_server`, the built-in
tiny model on the CPU). Two dp-size-2 servers are shared by the whole session, since each takes tens of seconds to
start on a small host; tests that kill a server start their own. The stand-in upstream (upstream.py) remains for
what a real server cannot show: the exact bytes the router forwarded, and latency to a few milliseconds.
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

from sglang_lite.utils.process import wait_until_healthy

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SERVER_STARTUP_TIMEOUT = (
    180.0  # a cold start imports torch and builds the model: ~20-40 s on 2 loaded cores
)
# Small pools keep every rank light; 1024 tokens of context leave room for the long generations some tests hold.
SERVER_FLAGS = [
    "--context-length",
    "1024",
    "--max-total-tokens",
    "16384",
    "--max-running-requests",
    "32",
    "--cpu-threads-per-rank",
    "1",
    "--log-level",
    "warning",
    "--load-format",
    "dummy",
]  # random weights


def upstream_command(
    port: int, dp_size: int, token_delay: float, name: str, *extra: str
) -> list[str]:
    return [
        sys.executable,
        str(HERE / "upstream.py"),
        "--port",
        str(port),
        "--dp-size",
        str(dp_size),
        "--token-delay",
        str(token_delay),
        "--name",
        name,
        *extra,
    ]


def server_command(port: int, dp_size: int, name: str, *extra: str) -> list[str]:
    """A real sglang_lite server; `name` becomes its served model name, so OpenAI responses say who answered."""
    return [
        sys.executable,
        "-m",
        "sglang_lite.launch_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dp-size",
        str(dp_size),
        "--served-model-name",
        name,
        *SERVER_FLAGS,
        *extra,
    ]


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
        """Signal the whole process group (the server and the ranks it spawned), then reap it."""
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
        try:  # a rank outliving its leader (it should not: it dies with its parent) still goes
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_healthy(self, timeout: float = SERVER_STARTUP_TIMEOUT) -> Proc:
        """Poll GET /health until 200; on failure kill the process and raise with its log."""
        if wait_until_healthy(self.url, self.popen, timeout, interval_s=0.25):
            return self
        text = self.output()
        self.kill()
        raise RuntimeError(f"{self.popen.args} did not become healthy:\n{text[-3000:]}")


def spawn(cmd: list[str], port: int = 0) -> Proc:
    """Start `cmd` in its own process group with output to a file (a pipe could fill and block it)."""
    log = Path(tempfile.mkstemp(prefix="router-test-", suffix=".log")[1])
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO
        )
    return Proc(popen, port, log)


def launch(cmd: list[str], ready: re.Pattern, timeout: float = 20.0) -> Proc:
    """Spawn `cmd` and wait for the `ready` line, whose first group is the bound port."""
    proc = spawn(cmd)
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


def spawn_server(
    dp_size: int, name: str, port: int | None = None, extra: tuple[str, ...] = ()
) -> Proc:
    """Start a real server without waiting, so several can start at once; call wait_healthy() on it."""
    port = port or free_port()
    return spawn(server_command(port, dp_size, name, *extra), port)


def start_upstream(
    dp_size: int = 1,
    token_delay: float = 0.0,
    port: int = 0,
    name: str = "upstream",
    extra: tuple[str, ...] = (),
) -> Proc:
    return launch(
        upstream_command(port, dp_size, token_delay, name, *extra), re.compile(r"READY port=(\d+)")
    )


def start_router(*args: str) -> Proc:
    cmd = [sys.executable, "-m", "sglang_lite.router", "--port", "0", "--log-level", "info", *args]
    return launch(cmd, re.compile(r"router listening on http://127\.0\.0\.1:(\d+)"))


class Procs:
    """Starts processes and kills every one of them at teardown, whatever happened in the test."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []

    def upstream(self, **kwargs) -> Proc:
        return self.adopt(start_upstream(**kwargs))

    def router(self, *args: str) -> Proc:
        return self.adopt(start_router(*args))

    def servers(
        self,
        names: list[str],
        dp_size: int = 1,
        port: int | None = None,
        extra: tuple[str, ...] = (),
    ) -> list[Proc]:
        """Real servers started together (one per name), each killed at teardown even if another fails to start."""
        started = [self.adopt(spawn_server(dp_size, name, port, extra)) for name in names]
        return [proc.wait_healthy() for proc in started]

    def adopt(self, proc: Proc) -> Proc:
        self.procs.append(proc)
        return proc

    def dump_logs(self) -> None:
        for proc in self.procs:  # the servers' logs explain most failures
            sys.stderr.write(f"\n--- {proc.popen.args[:5]} log ---\n{proc.output()[-4000:]}")

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
            group.dump_logs()
        group.kill_all()


@pytest.fixture(scope="session")
def dp_pair(request) -> list[Proc]:
    """Two real servers with dp-size 2, served model names s0 and s1, shared by the session's tests."""
    group = Procs()
    try:
        yield group.servers(["s0", "s1"], dp_size=2)
    finally:
        if request.session.testsfailed:
            group.dump_logs()
        group.kill_all()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
