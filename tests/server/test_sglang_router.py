"""The real sglang-router 0.3.2 (PyPI) in front of a dp 2 server, plain and --dp-aware."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest
import sglang_router  # noqa: F401  (not skipped when missing: the test extra pins sglang-router 0.3.2)

from sglang_lite.utils.process import wait_until_healthy
from tests.server.conftest import ServerProcess, free_port


class RouterProcess:
    def __init__(self, worker: ServerProcess, dp_aware: bool, log_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--worker-urls",
            worker.url,
            "--policy",
            "round_robin",
            "--worker-startup-check-interval",
            "1",
            "--log-level",
            "warn",
        ] + (["--dp-aware"] if dp_aware else [])
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.log_path = log_path

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        if wait_until_healthy(self.url, self.process, timeout_s, path="/v1/models", interval_s=0.3):
            return
        assert self.process.poll() is None, open(self.log_path).read()[-3000:]
        raise TimeoutError(open(self.log_path).read()[-3000:])

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        self._log.close()


@pytest.fixture(params=[False, True], ids=["plain", "dp_aware"])
def router(
    request: pytest.FixtureRequest, server_dp2: ServerProcess, tmp_path
) -> Iterator[RouterProcess]:
    process = RouterProcess(server_dp2, request.param, str(tmp_path / "router.log"))
    try:
        process.wait_ready()
        yield process
    finally:
        process.kill()


def routed_counts(server: ServerProcess) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{server.url}/metrics").text
    pattern = r'sglang_lite_requests_routed_total\{dp_rank="(\d)",how="(\w+)"\} (\S+)'
    return {(rank, how): float(n) for rank, how, n in re.findall(pattern, text)}


def test_requests_through_sglang_router(
    router: RouterProcess, server_dp2: ServerProcess, request: pytest.FixtureRequest
) -> None:
    dp_aware = "dp_aware" in request.node.name
    before = routed_counts(server_dp2)
    for _ in range(4):
        body = {
            "text": "through the router",
            "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
        }
        response = httpx.post(f"{router.url}/generate", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["meta_info"]["completion_tokens"] == 5
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0, timeout=60)
    chat = client.chat.completions.create(
        model="tiny_qwen3_5_moe",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage.completion_tokens == 4
    streamed = client.completions.create(
        model="tiny_qwen3_5_moe",
        prompt="hi",
        max_tokens=4,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "length"
    after = routed_counts(server_dp2)
    delta = {key: after.get(key, 0) - before.get(key, 0) for key in after}
    named = {rank: delta.get((rank, "named"), 0) for rank in ("0", "1")}
    if (
        dp_aware
    ):  # the router chose each rank (data_parallel_rank in the body), round robin over both
        assert named["0"] >= 2 and named["1"] >= 2, delta
    else:
        assert sum(named.values()) == 0 and sum(delta.values()) == 6, delta
