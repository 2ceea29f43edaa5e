"""Servers started as subprocesses on free ports, shared by the tests of a session and always killed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from sglang_lite.utils.process import wait_until_healthy

# Small limits keep every generation short on a 2-core CI machine; the engine uses the same ones for parity.
# the built-in model with random weights: serving mechanics should not change when the shipped weights are retrained
COMMON_FLAGS = [
    "--context-length",
    "512",
    "--max-total-tokens",
    "8192",
    "--max-running-requests",
    "16",
    "--load-format",
    "dummy",
]
STARTUP_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m sglang_lite.launch_server`` in its own process group, its output in a log file."""

    def __init__(self, extra_flags: list[str], log_path: str, api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        flags = [*COMMON_FLAGS, *extra_flags] + (["--api-key", api_key] if api_key else [])
        command = [
            sys.executable,
            "-m",
            "sglang_lite.launch_server",
            "--port",
            str(self.port),
            *flags,
        ]
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self) -> None:
        if wait_until_healthy(self.url, self.process, STARTUP_TIMEOUT_S):
            return
        if self.process.poll() is not None:
            raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
        raise TimeoutError(f"server not ready in {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-5000:]

    def kill(self) -> None:
        """The whole group (the HTTP process and its scheduler processes)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)
        _kill_group_leftovers(self.process.pid)
        self._log.close()


def _kill_group_leftovers(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def start_server(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    flags: list[str],
    api_key: str | None = None,
) -> Iterator[ServerProcess]:
    server = ServerProcess(flags, str(tmp_path_factory.mktemp(name) / "server.log"), api_key)
    try:
        server.wait_ready()
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def server_dp1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from start_server(tmp_path_factory, "dp1", ["--dp-size", "1", "--enable-cache-report"])


@pytest.fixture(scope="session")
def server_dp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from start_server(
        tmp_path_factory, "dp2", ["--dp-size", "2", "--load-balance-method", "round_robin"]
    )


@pytest.fixture(scope="session")
def small_queue_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """dp 1, an API key, a 4-request waiting queue and 2 running requests: easy to overload."""
    flags = [
        "--dp-size",
        "1",
        "--max-queued-requests",
        "4",
        "--max-running-requests",
        "2",
        "--max-request-body-bytes",
        "65536",
    ]
    yield from start_server(tmp_path_factory, "small_queue", flags, api_key="test-key")


@pytest.fixture(scope="session")
def tools_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """dp 1 with the Qwen3.5 parsers: tool calls (qwen3_coder) and reasoning (qwen3). A longer context than the
    others: two tools' definitions in the chat template take ~470 tokens, which 512 would leave ~40 of for a call
    that random weights may spell in more (a sampled call ended at the context once the sampler's draws changed)."""
    yield from start_server(
        tmp_path_factory,
        "tools",
        [
            "--tool-call-parser",
            "qwen3_coder",
            "--reasoning-parser",
            "qwen3",
            "--context-length",
            "1024",
        ],
    )


@pytest.fixture(params=["dp1", "dp2"])
def server(request: pytest.FixtureRequest) -> ServerProcess:
    return request.getfixturevalue(f"server_{request.param}")


def get_loads(server: ServerProcess, query: str = "") -> dict:
    response = httpx.get(f"{server.url}/v1/loads{query}", headers=server.headers, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def wait_idle(server: ServerProcess, timeout_s: float = 30.0) -> list[dict]:
    """Polls until every rank holds nothing; returns the last loads."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = get_loads(server)["loads"]
        if all(
            load["num_running_reqs"] == load["num_waiting_reqs"] == load["num_used_tokens"] == 0
            for load in loads
        ):
            return loads
        if time.monotonic() > deadline:
            raise AssertionError(f"ranks still busy after {timeout_s} s: {loads}")
        time.sleep(0.2)
