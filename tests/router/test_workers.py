"""Pure pieces of the router around the policies: breaker, health thresholds, /v1/loads parsing, bodies."""

from __future__ import annotations

import json

import pytest

from sglang_lite.router.app import key_matches
from sglang_lite.router.config import RouterConfig, config_from_args
from sglang_lite.router.health import record_health
from sglang_lite.router.load_monitor import apply_loads, parse_loads
from sglang_lite.router.proxy import forward_headers, shed_of, with_fields
from sglang_lite.router.request_info import batch_size, prompt_text
from sglang_lite.router.workers import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    CircuitBreaker,
    Server,
    WorkerRegistry,
    expand,
)


def test_breaker_opens_after_threshold_probes_after_timeout_and_closes_after_successes():
    cb = CircuitBreaker(failure_threshold=3, success_threshold=2, timeout_secs=10)
    for t in range(3):
        assert cb.allows(t)
        cb.record_failure(t)
    assert cb.state == OPEN and not cb.allows(5)
    assert cb.allows(12.0) and cb.state == HALF_OPEN
    cb.record_success()
    assert cb.state == HALF_OPEN
    cb.record_success()
    assert cb.state == CLOSED


def test_breaker_half_open_failure_reopens_and_success_resets_the_count():
    cb = CircuitBreaker(failure_threshold=2, success_threshold=1, timeout_secs=1)
    cb.record_failure(0)
    cb.record_success()
    cb.record_failure(0)
    assert cb.state == CLOSED  # failures must be consecutive
    cb.record_failure(0)
    assert cb.state == OPEN
    assert cb.allows(1.5)
    cb.record_failure(1.5)
    assert cb.state == OPEN and not cb.allows(2.0)


def test_health_thresholds():
    server = Server("http://a", None, CircuitBreaker())
    assert not record_health(server, False, 3, 2) and not record_health(server, False, 3, 2)
    assert record_health(server, False, 3, 2) and not server.healthy
    assert not record_health(server, True, 3, 2)
    assert record_health(server, True, 3, 2) and server.healthy


def test_dp_expansion_and_registry_views():
    reg = WorkerRegistry()
    reg.add(Server("http://a:1", 2, CircuitBreaker()))
    reg.add(Server("http://b:2", None, CircuitBreaker()))
    assert [v.url for v in reg.views(0)] == ["http://a:1@0", "http://a:1@1", "http://b:2"]
    with pytest.raises(ValueError):
        reg.add(Server("http://b:2", None, CircuitBreaker()))
    reg.remove("b:2")
    assert [v.dp_rank for v in reg.views(0)] == [0, 1]


def test_parse_loads_drops_missing_negative_and_duplicate_ranks():
    payload = {
        "loads": [
            {"dp_rank": 0, "num_total_tokens": 10},
            {"dp_rank": 1, "num_total_tokens": 20},
            {"dp_rank": 1, "num_total_tokens": 30},
            {"dp_rank": -1, "num_total_tokens": 5},
            {"num_total_tokens": 7},
            {"dp_rank": 2},
            {"dp_rank": 3, "num_total_tokens": 40},
        ]
    }
    assert parse_loads(payload) == {0: 10, 3: 40}
    assert parse_loads({"oops": 1}) == {} and parse_loads([1]) == {}


def test_parse_loads_reads_upstreams_nested_entries():
    """Core figures flat, sections as sub-objects (null when not asked for): the tokens are the flat ones."""
    entry = {
        "dp_rank": 1,
        "num_total_tokens": 12,
        "memory": None,
        "disaggregation": {"mode": "decode", "decode_transfer_queue_reqs": 3},
        "queues": {"waiting": 2},
    }
    assert parse_loads({"loads": [entry, {**entry, "dp_rank": 0, "num_total_tokens": 4}]}) == {
        1: 12,
        0: 4,
    }


def test_apply_loads_per_rank_and_failed_poll_clears():
    workers = expand(Server("http://a", 3, CircuitBreaker()))
    apply_loads(workers, {0: 10, 2: 30})
    assert [w.polled_tokens for w in workers] == [10, None, 30]
    apply_loads(workers, None)
    assert [w.polled_tokens for w in workers] == [None, None, None]
    whole = expand(Server("http://b", None, CircuitBreaker()))
    apply_loads(whole, {0: 10, 1: 5})
    assert whole[0].polled_tokens == 15


@pytest.mark.parametrize("raw", [b'{"text": "hi", "x": [1, {"y": 2}]}', b"{}", b' { "a" : 1 }\n'])
def test_with_fields_keeps_the_client_bytes_and_adds_the_rank(raw):
    out = with_fields(raw, {"routed_dp_rank": 3})
    assert out.startswith(raw.rstrip()[:-1])
    assert json.loads(out) == {**json.loads(raw), "routed_dp_rank": 3}
    assert (
        json.loads(with_fields(b'{"routed_dp_rank": 0}', {"routed_dp_rank": 1}))["routed_dp_rank"]
        == 1
    )


def test_prompt_text_and_batch_size():
    assert prompt_text({"text": "abc"}) == "abc" and prompt_text({"prompt": ["p1", "p2"]}) == "p1"
    assert prompt_text({"messages": [{"role": "user", "content": "x"}, {"content": "y"}]}) == "xy"
    assert prompt_text({"input_ids": [1, 2]}) == "1,2,"
    assert batch_size({"text": ["a", "b"]}) == 2 and batch_size({"input_ids": [[1], [2], [3]]}) == 3
    assert batch_size({"text": "a"}) is None


def test_cli_defaults_come_from_the_dataclass_and_flags_parse():
    assert config_from_args([]) == RouterConfig()
    cfg = config_from_args(
        [
            "--worker-urls",
            "http://a",
            "http://b",
            "--policy",
            "power_of_two",
            "--dp-aware",
            "--p2c-load-metric",
            "requests",
            "--max-concurrent-requests",
            "8",
            "--log-level",
            "warn",
        ]
    )
    assert (
        cfg.worker_urls == ("http://a", "http://b")
        and cfg.dp_aware
        and cfg.p2c_load_metric == "requests"
    )
    assert (
        cfg.max_concurrent_requests == 8 and cfg.log_level == "warning" and cfg.host == "127.0.0.1"
    )
    pd = config_from_args(
        [
            "--pd-disaggregation",
            "--prefill",
            "http://p1",
            "9000",
            "--prefill",
            "http://p2",
            "--decode",
            "http://d1",
            "--prefill-policy",
            "random",
            "--decode-policy",
            "power_of_two",
        ]
    )
    assert [(p.url, p.bootstrap_port) for p in pd.prefill] == [
        ("http://p1", 9000),
        ("http://p2", None),
    ]
    assert pd.decode == ("http://d1",) and pd.prefill_policy == "random"


def test_cli_help_imports_neither_torch_nor_the_http_stack():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "sglang_lite.router", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert "--pd-disaggregation" in out.stdout
    assert not {m for m in imported if m.split(".")[0] in ("torch", "triton", "aiohttp")}


def test_worker_key_defaults_to_the_api_key_and_empty_means_none():
    assert RouterConfig(api_key="k").worker_key == "k"
    assert RouterConfig(api_key="k", worker_api_key="w").worker_key == "w"
    assert RouterConfig(api_key="k", worker_api_key="").worker_key is None
    assert config_from_args(["--worker-api-key", "w"]).worker_key == "w"


def test_forwarded_headers_carry_the_worker_key_instead_of_the_clients():
    client = {"authorization": "Bearer client", "X-Trace": "1", "Host": "router"}
    assert forward_headers(client) == {
        "authorization": "Bearer client",
        "X-Trace": "1",
    }  # no worker key: as sent
    assert forward_headers(client, "wk") == {"X-Trace": "1", "Authorization": "Bearer wk"}
    assert forward_headers({}, "wk") == {"Authorization": "Bearer wk"}


def test_key_check_is_exact():
    assert key_matches("Bearer s3cret", "s3cret")
    assert not key_matches("Bearer s3creT", "s3cret") and not key_matches(None, "s3cret")
    assert not key_matches("Bearer s3cret ", "s3cret") and not key_matches(
        "Bearer \u00e9", "s3cret"
    )


class _Head:
    def __init__(self, status: int, headers: dict) -> None:
        self.status, self.headers = status, headers


def test_shedding_needs_retry_after_or_a_dead_rank():
    full = _Head(503, {"Retry-After": "2"})
    shed = shed_of(full, b'{"error": {"message": "rank 0: the waiting queue is full"}}')
    assert shed is not None and shed.retry_after == 2.0 and shed.dead_rank is None
    assert shed.response.status == 503 and shed.response.headers["Retry-After"] == "2"
    assert shed_of(_Head(429, {"Retry-After": "1"}), b"{}").retry_after == 1.0
    dead = shed_of(_Head(503, {}), b'{"error": {"message": "DP rank 3 died: exit code -9"}}')
    assert dead is not None and dead.dead_rank == 3 and dead.retry_after is None
    assert (
        shed_of(_Head(503, {}), b'{"error": "out of memory"}') is None
    )  # a plain 503 is a failure
    assert (
        shed_of(_Head(429, {}), b"DP rank 1 is not alive") is None
    )  # only a 503 names a dead rank


def test_a_rank_marked_down_is_unhealthy_until_its_time_or_a_probe():
    reg = WorkerRegistry()
    server = Server("http://a:1", 2, CircuitBreaker())
    reg.add(server)
    server.workers[1].mark_rank_down(10.0, 5.0)
    assert [v.healthy for v in reg.views(12.0)] == [True, False]
    assert [v.healthy for v in reg.views(15.0)] == [True, True]
    server.workers[1].mark_rank_down(20.0)  # a failed probe: until a probe sees it again
    assert not reg.views(1e9)[1].healthy
    server.workers[1].mark_rank_up()
    assert reg.views(21.0)[1].healthy and server.healthy


def test_rank_probes_mark_only_silent_ranks_and_only_while_the_server_answers(monkeypatch):
    import asyncio

    import sglang_lite.router.health as health

    server = Server("http://a:1", 3, CircuitBreaker())
    WorkerRegistry().add(server)
    checker = health.HealthChecker(None, lambda: [server], RouterConfig())
    answering: set[int] = set()

    async def fake_probe(
        session, url, endpoint, timeout
    ):  # /health fails; ranks in `answering` answer
        return endpoint != "/health" and int(endpoint.rsplit("=", 1)[1]) in answering

    monkeypatch.setattr(health, "probe", fake_probe)

    def check(ranks: set[int]) -> list[bool]:
        answering.clear()
        answering.update(ranks)
        asyncio.run(checker.check(server))
        return [w.rank_up(1e9) for w in server.workers]

    assert check({0, 2}) == [True, False, True] and server.healthy and server.health_failures == 0
    assert check(set()) == [
        True,
        False,
        True,
    ]  # nothing answers: a server failure (1 of 3), no rank marked
    assert server.health_failures == 1 and server.healthy
    assert check({0, 1, 2}) == [True, True, True]


def test_a_stream_failing_inside_an_event_ends_with_a_whole_error_event():
    """The upstream dies after half an event: the client gets the whole events before it, then the error event,
    never the half event glued to it."""
    import asyncio
    import json

    from sglang_lite.router.proxy import FIRST_EVENT_AT, _pump

    class Content:
        async def iter_any(self):
            yield b'data: {"text": "a"}\n\ndata: {"te'
            raise asyncio.TimeoutError()

    class Upstream:
        content = Content()

    class Client(
        dict
    ):  # a response is a mapping too: the relay notes when the first event went out
        def __init__(self) -> None:
            super().__init__()
            self.body = b""

        async def write(self, data: bytes) -> None:
            self.body += data

    client = Client()
    assert asyncio.run(_pump(client, Upstream(), whole_events=True)) is True
    assert isinstance(client[FIRST_EVENT_AT], float)  # the router's TTFT reads it
    events = [json.loads(e.removeprefix(b"data: ")) for e in client.body.split(b"\n\n") if e]
    assert (
        events[0] == {"text": "a"} and "upstream failed mid-stream" in events[1]["error"]["message"]
    )
    assert len(events) == 2
