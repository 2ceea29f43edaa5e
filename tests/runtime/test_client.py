"""The client core on real scheduler processes: start-up failures are reported and stop everything."""
from __future__ import annotations

import pytest

from sglang_lite import Engine
from sglang_lite.runtime.client import SchedulerClient
from sglang_lite.runtime.messages import CheckQuery, CheckReply, LoadsQuery, LoadsReply
from sglang_lite.server_args import ServerArgs


def test_a_rank_that_fails_to_start_is_reported_and_every_rank_is_stopped(tmp_path):
    client = SchedulerClient(ServerArgs(model_path=str(tmp_path / "missing"), skip_tokenizer_init=True, dp_size=2,
                                        cpu_threads_per_rank=1))
    with pytest.raises(RuntimeError, match="failed to start: .*missing"):
        client.wait_ready(timeout_s=120)
    assert all(process.poll() is not None for process in client.processes)
    client.shutdown()  # again: nothing left to do


def test_queries_are_answered_by_the_rank_they_were_sent_to():
    client = SchedulerClient(ServerArgs(max_total_tokens=256, max_running_requests=2, skip_tokenizer_init=True,
                                        dp_size=2, cpu_threads_per_rank=1))
    try:
        ready = client.wait_ready(timeout_s=300)
        assert [r.rank for r in ready] == [0, 1] and client.config.max_total_tokens == 256
        client.send(1, LoadsQuery(client.next_query_id(), ("core",)))
        client.send(0, CheckQuery(client.next_query_id()))
        replies = [client.receive(30_000) for _ in range(2)]
        loads = next(r for r in replies if isinstance(r, LoadsReply))
        check = next(r for r in replies if isinstance(r, CheckReply))
        assert (loads.rank, loads.loads["dp_rank"], loads.loads["num_running_reqs"]) == (1, 1, 0)
        assert "weight_gb" not in loads.loads  # only the sections asked for
        assert (check.rank, check.error) == (0, None)
    finally:
        client.shutdown()
    assert all(process.poll() is not None for process in client.processes)


def test_the_engine_runs_one_scheduler():
    with pytest.raises(ValueError, match="dp_size: the Engine runs one scheduler, got 2"):
        Engine(dp_size=2, skip_tokenizer_init=True)
