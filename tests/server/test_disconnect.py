"""Clients that hang up mid-stream: their requests are aborted on their ranks and all memory is freed."""
from __future__ import annotations

import asyncio
import re

import httpx

from tests.server.conftest import ServerProcess, get_loads, wait_idle

CLIENTS = 50
# 50 x 400 tokens would keep the ranks busy for minutes; idle within seconds proves the aborts
BODY = {"text": "hang up", "stream": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}


async def _hang_up_after_first_event(server: ServerProcess, path: str, body: dict) -> bool:
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", f"{server.url}{path}", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    return True
    return False


async def _hang_up_all(server: ServerProcess) -> list[bool]:
    chat = {"messages": [{"role": "user", "content": "hang up"}], "max_tokens": 400, "ignore_eos": True, "stream": True}
    jobs = [_hang_up_after_first_event(server, "/generate", BODY) for _ in range(CLIENTS - 10)]
    jobs += [_hang_up_after_first_event(server, "/v1/chat/completions", chat) for _ in range(10)]
    return list(await asyncio.gather(*jobs))


def aborted_by_ranks(server: ServerProcess) -> float:
    """Requests the schedulers ended with an abort finish reason (counted from their own outputs)."""
    text = httpx.get(f"{server.url}/metrics").text
    pattern = r'sglang_lite_requests_finished_total\{dp_rank="\d",reason="abort"\} (\S+)'
    return sum(float(n) for n in re.findall(pattern, text))


def test_fifty_hang_ups_leave_the_loads_at_zero(server_dp2: ServerProcess) -> None:
    wait_idle(server_dp2)
    before = aborted_by_ranks(server_dp2)
    assert all(asyncio.run(_hang_up_all(server_dp2)))
    loads = wait_idle(server_dp2, timeout_s=30)
    assert all(load["num_total_tokens"] == 0 and load["token_usage"] == 0 for load in loads)
    assert sum(load["num_running_reqs"] for load in get_loads(server_dp2)["loads"]) == 0
    assert aborted_by_ranks(server_dp2) - before == CLIENTS  # ended by abort, not by running to their length


async def _abandon_non_streaming(server: ServerProcess) -> None:
    body = {**BODY, "stream": False}
    async with httpx.AsyncClient(timeout=0.5) as client:
        try:
            await client.post(f"{server.url}/generate", json=body)
        except httpx.TimeoutException:
            pass


def test_abandoned_non_streaming_requests_are_aborted(server_dp2: ServerProcess) -> None:
    wait_idle(server_dp2)

    async def abandon_all() -> None:
        await asyncio.gather(*(_abandon_non_streaming(server_dp2) for _ in range(10)))

    before = aborted_by_ranks(server_dp2)
    asyncio.run(abandon_all())
    wait_idle(server_dp2, timeout_s=20)
    assert aborted_by_ranks(server_dp2) - before == 10
