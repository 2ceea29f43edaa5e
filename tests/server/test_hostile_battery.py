"""The hostile battery (tests/tools/hostile_cases.py, about 125 requests) against a ``--dp-size 2`` server with
the Qwen3.5 parsers, eight at a time: each is a 4xx with the JSON error body or a right 200 within 30 s; then no
rank died or was restarted, both hold nothing, and every rid a case used serves again."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import ServerProcess, start_server
from tests.tools.hostile import rids_reusable, run_battery, used_rids, wait_idle
from tests.tools.hostile_cases import hostile_cases

# refusals whose message this work added: the battery must get them for the right reason
MESSAGES = {
    "a regex that cannot finish": "regex admits no output: no finite text",
    "EBNF that never finishes": "ebnf admits no output: no finite text",
    "a schema that requires itself": "json_schema admits no output: no finite text",
    "a schema nested 200 deep": "nests 201 levels deep",
    "a 64 KB schema that compiles for minutes": "json_schema is too complex",
    "a structural tag of an unknown type": "structural_tag does not compile",
    "17 prompts x n=64": "1088 requests in one, more than --max-queued-requests",
    "echo, top 100 logprobs, n=64 of a 400-token prompt": "log-probability entries asked for",
    "slowloris headers (a byte every 0.5 s)": "headers did not arrive within 10 s",
    "a body stalled half-way": "body did not arrive within 20 s",
    "Content-Length and Transfer-Encoding, a request smuggled after the chunked body": (
        "both Content-Length and Transfer-Encoding"
    ),
    "200,000 messages without content": "200000 messages, content parts and tool calls",
    "200,000 messages of empty content": "200000 messages, content parts and tool calls",
    "200,000 empty content parts": "200001 messages, content parts and tool calls",
}


@pytest.fixture(scope="module")
def parsers_dp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    flags = [
        "--dp-size",
        "2",
        "--cpu-threads-per-rank",
        "1",
        "--tool-call-parser",
        "qwen3_coder",
        "--reasoning-parser",
        "qwen3",
    ]
    yield from start_server(tmp_path_factory, "parsers_dp2", flags)


def test_the_hostile_battery_gets_only_refusals_and_right_answers(
    parsers_dp2: ServerProcess,
) -> None:
    cases = hostile_cases()
    assert len(cases) >= 100 and len({c.name for c in cases}) == len(cases)
    pids = httpx.get(f"{parsers_dp2.url}/server_info", timeout=30).json()["scheduler_pids"]
    outcomes = asyncio.run(run_battery(parsers_dp2.url, cases, concurrency=8))
    failed = [str(o) for o in outcomes if not o.ok]
    assert not failed, "\n".join(failed)
    by_name = {o.case.name: o for o in outcomes}
    for name, needle in MESSAGES.items():
        assert needle in by_name[name].message, (name, by_name[name].message)
    assert all(o.seconds < 30 for o in outcomes)

    async def afterwards() -> list[str]:
        async with httpx.AsyncClient(base_url=parsers_dp2.url, timeout=30) as client:
            await wait_idle(client)
            return await rids_reusable(client, used_rids(cases), {})

    assert asyncio.run(afterwards()) == []
    assert httpx.get(f"{parsers_dp2.url}/health", timeout=30).status_code == 200
    after = httpx.get(f"{parsers_dp2.url}/server_info", timeout=30).json()["scheduler_pids"]
    assert after == pids, "no rank died or was restarted"
