"""Clients that hang up mid-stream: their requests are aborted on their ranks and all memory is freed."""

from __future__ import annotations

import asyncio
import re

import httpx

from tests.server.conftest import ServerProcess, get_loads, wait_idle

CLIENTS = 50
# 50 x 400 tokens would keep the ranks busy for minutes; idle within seconds proves the aborts
BODY = {
    "text": "hang up",
    "stream": True,
    "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
}


async def _hang_up_after_first_event(server: ServerProcess, path: str, body: dict) -> bool:
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", f"{server.url}{path}", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    return True
    return False


async def _hang_up_all(server: ServerProcess) -> list[bool]:
    chat = {
        "messages": [{"role": "user", "content": "hang up"}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
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
    assert (
        aborted_by_ranks(server_dp2) - before == CLIENTS
    )  # ended by abort, not by running to their length


async def _requests_present(server: ServerProcess) -> int:
    async with httpx.AsyncClient(timeout=10) as client:
        loads = (await client.get(f"{server.url}/v1/loads")).json()["loads"]
    return sum(load["num_running_reqs"] + load["num_waiting_reqs"] for load in loads)


async def _abandon_once_all_arrived(server: ServerProcess, count: int) -> None:
    """Sends `count` non-streaming requests and closes their connections once the ranks hold all of them.

    Hanging up only after the ranks report every request makes the count exact: a client-side timeout could fire
    before a loaded server read the request, or after a fast one finished it."""
    body = {
        **BODY,
        "stream": False,
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
    }
    async with httpx.AsyncClient(timeout=120) as client:
        posts = [
            asyncio.create_task(client.post(f"{server.url}/generate", json=body))
            for _ in range(count)
        ]
        try:
            deadline = asyncio.get_running_loop().time() + 20
            while await _requests_present(server) < count:
                assert asyncio.get_running_loop().time() < deadline, (
                    "the ranks never held every request"
                )
                assert not any(post.done() for post in posts), (
                    "a request ended before the client hung up"
                )
                await asyncio.sleep(0.02)
        finally:
            for post in posts:
                post.cancel()
            await asyncio.gather(*posts, return_exceptions=True)


def test_abandoned_non_streaming_requests_are_aborted(server_dp2: ServerProcess) -> None:
    wait_idle(server_dp2)
    before = aborted_by_ranks(server_dp2)
    asyncio.run(_abandon_once_all_arrived(server_dp2, 10))
    wait_idle(server_dp2, timeout_s=20)
    assert aborted_by_ranks(server_dp2) - before == 10
