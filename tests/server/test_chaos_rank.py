"""Chaos on a real dp-size 2 server: a rank killed (kill -9) or hung (SIGSTOP) under streaming load.

Its requests fail cleanly (an SSE error event with 503), the other rank's finish, ``/health`` says degraded and then
ok once the supervisor has restarted the rank, and both ranks serve again with nothing left held.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import ServerProcess, start_server, wait_idle

NEW_TOKENS = 450  # long enough to be mid-stream when the rank goes (context 512)
HANG_TIMEOUT_S = 5


@pytest.fixture(scope="module")
def chaos_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    flags = [
        "--dp-size",
        "2",
        "--load-balance-method",
        "round_robin",
        "--rank-hang-timeout-s",
        str(HANG_TIMEOUT_S),
        "--cpu-threads-per-rank",
        "1",
    ]
    yield from start_server(tmp_path_factory, "chaos", flags)


def rank_pids(server: ServerProcess) -> list[int]:
    return httpx.get(f"{server.url}/server_info", timeout=10).json()["scheduler_pids"]


def stream_on(
    server: ServerProcess, rank: int, started: threading.Event, at_first=None
) -> list[dict]:
    """One streaming request on ``rank``; its events (``started`` is set at the first one, after ``at_first``
    runs)."""
    body = {
        "text": f"chaos on rank {rank}",
        "stream": True,
        "routed_dp_rank": rank,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 0.0},
    }
    events = []
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
                if at_first is not None and len(events) == 1:
                    at_first()
                started.set()
    return events


def wait_health(server: ServerProcess, status: int, timeout_s: float) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        response = httpx.get(f"{server.url}/health", timeout=10)
        if response.status_code == status:
            return response
        assert time.monotonic() < deadline, (
            f"/health not {status} in {timeout_s} s: {response.text}"
        )
        time.sleep(0.1)


def under_load(
    server: ServerProcess, victim: int, signum: int
) -> tuple[list[list[dict]], list[list[dict]]]:
    """One stream on the victim rank, two on the other; the thread reading the victim's stream sends ``signum`` to
    the victim rank's process as soon as it has read its first event, so that stream cannot have finished however
    fast the rank generates (unless the client thread is starved until the rank has finished: see
    ``caught_mid_stream``). Returns the events of the victim's stream and of the others'."""
    pid = rank_pids(server)[victim]
    ranks = [victim, 1 - victim, 1 - victim]
    starts = [threading.Event() for _ in ranks]

    def kill() -> None:
        os.kill(pid, signum)

    with ThreadPoolExecutor(len(ranks)) as pool:
        futures = [
            pool.submit(stream_on, server, rank, started, kill if rank == victim else None)
            for rank, started in zip(ranks, starts)
        ]
        assert starts[0].wait(60), "the victim's stream did not start"
        degraded = wait_health(server, 503, 5 + HANG_TIMEOUT_S)
        results = [future.result(timeout=120) for future in futures]
    assert degraded.json()["status"] == "degraded"
    assert degraded.json()["ranks"][victim]["state"] in ("down", "starting")
    assert degraded.json()["ranks"][1 - victim]["state"] == "up"
    return (
        [r for r, k in zip(results, ranks) if k == victim],
        [r for r, k in zip(results, ranks) if k != victim],
    )


def assert_recovered(server: ServerProcess, victim: int, old_pid: int) -> None:
    wait_health(server, 200, 150)  # restarted: 1 s backoff, then the start-up of a rank
    assert rank_pids(server)[victim] != old_pid
    for rank in (0, 1):  # both serve again
        body = {
            "text": "after",
            "routed_dp_rank": rank,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
        }
        response = httpx.post(f"{server.url}/generate", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["meta_info"]["dp_rank"] == rank
    wait_idle(server)


def assert_clean_split(failed: list[list[dict]], finished: list[list[dict]]) -> None:
    for events in failed:  # some tokens, then one error event: 503 naming the dead rank
        assert events[-1]["error"]["code"] == 503 and "died" in events[-1]["error"]["message"], (
            events[-1]
        )
    for events in finished:
        assert "error" not in events[-1] and len(events[-1]["output_ids"]) == NEW_TOKENS
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


ATTEMPTS = 3


def caught_mid_stream(
    server: ServerProcess, victim: int, signum: int
) -> tuple[int, list[list[dict]], list[list[dict]]]:
    """``under_load`` until the signal caught the victim's stream mid-way; the victim's old pid and the streams.

    The signal goes at the victim stream's first event as the client reads it; a client thread starved for long
    enough on a loaded host reads it after the rank has generated every token, and the stream then finishes whole
    while the rank is stopped or killed idle. That attempt is checked for what it is (a whole answer; the rank still
    goes down and comes back) and the scenario runs again."""
    for _ in range(ATTEMPTS):
        old_pid = rank_pids(server)[victim]
        failed, finished = under_load(server, victim, signum)
        if "error" in failed[0][-1]:
            return old_pid, failed, finished
        assert len(failed[0][-1]["output_ids"]) == NEW_TOKENS, failed[0][-1]
        assert_clean_split([], finished)
        assert_recovered(server, victim, old_pid)
    raise AssertionError(f"the victim's stream finished before the signal in {ATTEMPTS} attempts")


def test_a_killed_rank_fails_only_its_requests_and_comes_back(chaos_server: ServerProcess) -> None:
    old_pid, failed, finished = caught_mid_stream(chaos_server, 1, signal.SIGKILL)
    assert_clean_split(failed, finished)
    assert_recovered(chaos_server, 1, old_pid)


def test_a_hung_rank_is_killed_and_restarted(chaos_server: ServerProcess) -> None:
    wait_health(chaos_server, 200, 150)
    old_pid, failed, finished = caught_mid_stream(chaos_server, 0, signal.SIGSTOP)
    assert_clean_split(failed, finished)
    assert "hung" in failed[0][-1]["error"]["message"]
    assert_recovered(chaos_server, 0, old_pid)
