"""The supervisor with multi-process worlds (--tp-size > 1): a death fails every DP rank of its world for good and
their requests at once; other worlds stay up; nothing is restarted."""

from __future__ import annotations

import asyncio

from sglang_lite.server.tokenizer_manager import (
    FAILED,
    UP,
    RequestError,
    RequestStream,
    TokenizerManager,
)
from sglang_lite.server_args import ServerArgs
from tests.server.test_supervisor import FakeClient, states


def manager(**layout: object) -> TokenizerManager:
    m = TokenizerManager(ServerArgs(tp_size=2, dp_size=2, rank_hang_timeout_s=1000.0, **layout))
    m.client = FakeClient(2)
    for health in m.ranks:
        health.set(UP, 0.0)
    return m


def test_a_dead_replica_world_fails_its_dp_rank_for_good_and_leaves_the_other_up():
    async def scenario() -> None:
        m = manager()  # two worlds of two processes
        m.streams["r1"] = stream = RequestStream(m, "r1", 1, 3)
        m.client.exited[1] = -9
        for now in (0.0, 100.0, 200.0):  # no restart, however long we wait
            m._check_ranks(now=now)
        assert states(m) == [UP, FAILED] and m.client.respawned == [] and m.client.killed == [1]
        error = stream.queue.get_nowait()
        assert (
            isinstance(error, RequestError)
            and error.status == 503
            and "cannot be restarted" in error.message
        )

    asyncio.run(scenario())


def test_a_dp_attention_world_fails_all_its_dp_ranks_on_one_fatal():
    async def scenario() -> None:
        m = manager(enable_dp_attention=True)  # one world holds both DP ranks
        streams = [RequestStream(m, f"r{r}", r, 3) for r in (0, 1)]
        m.streams.update({s.rid: s for s in streams})
        m.on_fatal(1, "CollectiveError: broadcast_object failed")
        m.on_fatal(
            0, "CollectiveError: broadcast_object failed"
        )  # rank 0 reports every DP rank it hosts
        assert states(m) == [FAILED, FAILED] and m.client.killed == [1] and m.client.respawned == []
        assert all(isinstance(s.queue.get_nowait(), RequestError) for s in streams)
        assert "CollectiveError" in m.rank_states()[0]["last_error"]

    asyncio.run(scenario())
