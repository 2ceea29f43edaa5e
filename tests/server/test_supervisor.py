"""The tokenizer manager's rank supervisor on a fake client (no processes): deaths, hangs, backoff, the restart
limit, and requests that failed inside a rank."""

from __future__ import annotations

import asyncio
import itertools
import time
from types import SimpleNamespace

import pytest

from sglang_lite.protocol.outputs import ReqOutput
from sglang_lite.runtime.messages import LoadsQuery, LoadsReply, Ready
from sglang_lite.server.tokenizer_manager import (
    DOWN,
    FAILED,
    STARTING,
    UP,
    RequestError,
    RequestStream,
    TokenizerManager,
)
from sglang_lite.server_args import ServerArgs


class FakeClient:
    def __init__(self, dp_size: int) -> None:
        self.processes = [SimpleNamespace(pid=100 + r) for r in range(dp_size)]
        self.exited: dict[int, int] = {}
        self.sent: list[tuple[int, object]] = []
        self.killed: list[int] = []
        self.respawned: list[int] = []
        self._ids = itertools.count()

    def exited_ranks(self) -> dict[int, int]:
        return dict(self.exited)

    def kill(self, rank: int) -> None:
        self.killed.append(rank)

    def respawn(self, rank: int) -> None:
        self.respawned.append(rank)
        self.exited.pop(rank, None)

    def send(self, rank: int, command: object) -> bool:
        self.sent.append((rank, command))
        return True

    def next_query_id(self) -> int:
        return next(self._ids)


def manager(max_restarts: int = 2, hang_timeout_s: float = 5.0) -> TokenizerManager:
    m = TokenizerManager(
        ServerArgs(dp_size=2, rank_hang_timeout_s=hang_timeout_s, rank_max_restarts=max_restarts)
    )
    m.client = FakeClient(2)
    for health in m.ranks:
        health.set(UP, 0.0)
    return m


def states(m: TokenizerManager) -> list[str]:
    return [h.state for h in m.ranks]


def test_a_dead_rank_fails_its_requests_at_once_and_restarts_with_backoff_up_to_the_limit():
    async def scenario() -> None:
        m = manager(max_restarts=2, hang_timeout_s=1000.0)  # probes are never answered here
        t0 = time.monotonic()  # a death is timed by the clock; the backoffs run from it
        stream = RequestStream(m, "r1", 1, 3)
        m.streams["r1"] = stream
        m.client.exited[1] = -9
        m._check_ranks(now=t0)
        assert states(m) == [UP, DOWN] and m.live == [True, False]
        error = stream.queue.get_nowait()
        assert (
            isinstance(error, RequestError)
            and error.status == 503
            and "exit code -9" in error.message
        )
        m._check_ranks(now=t0 + 0.5)  # backoff: 1 s
        assert m.client.respawned == []
        m._check_ranks(now=t0 + 1.5)
        assert states(m) == [UP, STARTING] and m.client.respawned == [1]
        m.on_ready(Ready(1, 200, None, None))
        assert states(m) == [UP, UP]
        m.client.exited[1] = 1  # dies again: the next wait doubles
        t0 = time.monotonic() - 10
        m._check_ranks(now=t0 + 10)
        m._check_ranks(now=t0 + 11.5)
        assert m.client.respawned == [1]
        m._check_ranks(now=t0 + 12.5)
        assert m.client.respawned == [1, 1] and m.ranks[1].restarts == 2
        m.client.exited[1] = 1  # exits during start-up: a failed restart, and no restarts are left
        m._check_ranks(now=t0 + 13)
        assert states(m) == [UP, DOWN]
        m._check_ranks(now=t0 + 60)
        assert states(m) == [UP, FAILED] and m.client.respawned == [1, 1]
        assert m.rank_states()[1]["state"] == FAILED and m.rank_states()[1]["restarts"] == 2

    asyncio.run(scenario())


def test_a_rank_that_leaves_a_loads_query_unanswered_is_hung_and_killed():
    m = manager()
    m._check_ranks(now=1.0)  # probes both ranks
    probes = {rank: command for rank, command in m.client.sent if isinstance(command, LoadsQuery)}
    assert sorted(probes) == [0, 1]
    m.on_query_reply(LoadsReply(0, probes[0].query_id, {}))  # rank 0 answers, rank 1 does not
    m._check_ranks(now=5.0)
    assert states(m) == [UP, UP]
    m._check_ranks(now=6.5)
    assert states(m) == [UP, DOWN] and m.client.killed == [1] and "hung" in m.ranks[1].why


def test_a_request_that_failed_inside_its_rank_ends_with_a_500_and_the_rank_stays_up():
    async def scenario() -> None:
        m = manager()
        stream = RequestStream(m, "r0", 0, 3)
        m.streams["r0"] = stream
        reason = {
            "type": "abort",
            "message": "internal error: RuntimeError: boom",
            "status_code": 500,
        }
        m.on_outputs(0, [ReqOutput("r0", [7], "", True, {"finish_reason": reason})])
        with pytest.raises(RequestError) as error:
            [output async for output in stream]
        assert error.value.status == 500 and "boom" in error.value.message
        assert states(m) == [UP, UP]

    asyncio.run(scenario())


def test_abort_skips_a_rank_that_is_down():
    async def scenario() -> None:
        m = manager()
        m.streams["r1"] = RequestStream(m, "r1", 1, 3)
        m.client.exited[1] = -9
        m._check_ranks(now=1.0)
        m.client.sent.clear()
        assert m.abort("r1") and m.abort_all() == 1
        assert m.client.sent == []

    asyncio.run(scenario())
