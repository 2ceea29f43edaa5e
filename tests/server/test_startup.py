"""A new user's first minute: the server binds first, says ``ready:`` when it serves (a request sent at once is
answered), fails in one line, and ``--log-level`` quiets every process; the router waits for its servers without
sleeping through their start and fails in one line too."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from tests.server.conftest import COMMON_FLAGS, free_port

STARTUP_TIMEOUT_S = 180.0


class Launched:
    """A command in its own process group whose stderr (and stdout) lines are read by a thread."""

    def __init__(self, command: list[str]) -> None:
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.seen: dict[str, float] = {}
        self._new_line = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self._new_line:
                self.lines.append(line.rstrip("\n"))
                self._new_line.notify_all()
        with self._new_line:
            self._new_line.notify_all()

    def wait_for(self, prefix: str, timeout_s: float = STARTUP_TIMEOUT_S) -> str:
        """The first line that starts with (or contains) ``prefix``; raises if the process ends first."""
        deadline = time.monotonic() + timeout_s
        with self._new_line:
            while True:
                found = next((line for line in self.lines if prefix in line), None)
                if found is not None:
                    return found
                if self.process.poll() is not None and not self._new_line.wait(0.5):
                    raise AssertionError(f"exited {self.process.returncode}: {self.lines[-20:]}")
                if time.monotonic() > deadline:
                    raise TimeoutError(self.lines[-20:])
                self._new_line.wait(max(deadline - time.monotonic(), 0.0))

    def finish(self, timeout_s: float = 60.0) -> int:
        code = self.process.wait(timeout_s)
        self._reader.join(10)  # every line it printed is read
        return code

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def server_command(port: int, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "sglang_lite.launch_server",
        "--port",
        str(port),
        *COMMON_FLAGS,
        "--cpu-threads-per-rank",
        "1",
        *flags,
    ]


def router_command(port: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "sglang_lite.router", "--port", str(port), *flags]


def test_a_request_sent_at_the_ready_line_is_answered_and_warning_quiets_every_process():
    port = free_port()
    server = Launched(server_command(port, "--dp-size", "2", "--log-level", "warning"))
    try:
        ready = server.wait_for("ready: ")
        assert ready.startswith(f"ready: http://127.0.0.1:{port} (") and "dp 2" in ready
        body = {"text": "def f(", "sampling_params": {"max_new_tokens": 4}}
        answer = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
    finally:
        server.stop()
    assert not [line for line in server.lines if " INFO " in line], server.lines


def test_a_port_in_use_is_one_line_before_anything_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        server = Launched(server_command(port))
        try:
            assert server.finish(60) == 1
        finally:
            server.stop()
        assert time.monotonic() - started < 30  # no model was loaded first
    assert len(server.lines) == 1 and server.lines[0].startswith("error: cannot listen on")
    assert "--port" in server.lines[0]


def test_bad_flags_are_one_line_and_status_2():
    bad_pd = [
        "--disaggregation-mode",
        "decode",
        "--tp-size",
        "3",
        "--dp-size",
        "2",
        "--enable-dp-attention",
    ]
    too_few = [
        "--enable-dp-attention",
        "--tp-size",
        "4",
        "--dp-size",
        "4",
        "--max-running-requests",
        "2",
    ]
    for flags in (["--bogus"], bad_pd, too_few):
        done = subprocess.run(
            server_command(free_port(), *flags), capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2
        lines = (done.stdout + done.stderr).strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("launch_server: error: "), lines


def test_a_router_started_with_its_server_listens_soon_after_the_server_is_ready():
    server_port = free_port()
    router_port = free_port()
    server = Launched(server_command(server_port))
    router = Launched(
        router_command(router_port, "--worker-urls", f"http://127.0.0.1:{server_port}")
    )
    try:
        server.wait_for("ready: ")
        ready_at = time.monotonic()
        router.wait_for("router listening on", timeout_s=30)
        assert time.monotonic() - ready_at < 5
    finally:
        router.stop()
        server.stop()


def test_a_dp_aware_router_without_its_workers_key_exits_in_one_line():
    server_port = free_port()
    server = Launched(server_command(server_port, "--api-key", "KEY"))
    try:
        server.wait_for("ready: ")
        flags = ["--worker-urls", f"http://127.0.0.1:{server_port}", "--dp-aware"]
        router = Launched(router_command(free_port(), *flags))
        try:
            assert router.finish(30) == 1
        finally:
            router.stop()
    finally:
        server.stop()
    assert len(router.lines) <= 3 and not any("Traceback" in line for line in router.lines)
    assert "--worker-api-key" in router.lines[-1], router.lines


def test_a_router_whose_worker_never_answers_exits_in_one_line():
    flags = ["--worker-urls", f"http://127.0.0.1:{free_port()}"]
    router = Launched(router_command(free_port(), *flags, "--worker-startup-timeout-secs", "2"))
    try:
        assert router.finish(30) == 1
    finally:
        router.stop()
    assert router.lines == [router.lines[0]] and "did not become ready in 2.0s" in router.lines[0]
