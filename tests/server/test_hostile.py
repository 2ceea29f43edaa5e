"""50 hostile requests in parallel with normal traffic on a dp-size 2 server: every hostile one is a 400, no
normal request is lost, and both ranks keep serving with nothing left behind."""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx

from tests.server.conftest import ServerProcess, wait_idle
from tests.server.test_bad_input import HOSTILE

HOSTILE_COUNT = 50
NORMAL_PER_RANK = 4
NEW_TOKENS = 6


def _hostile_bodies() -> list[tuple[str, bytes]]:
    small = [(path, json.dumps(body).encode()) for path, body, _ in HOSTILE]
    huge = [item for item in small if len(item[1]) > 100_000][
        :2
    ]  # two huge texts; more would only load the CPU
    rest = [item for item in small if len(item[1]) <= 100_000]
    return list(itertools.islice(itertools.cycle(rest), HOSTILE_COUNT - len(huge))) + huge


async def _post(client: httpx.AsyncClient, path: str, content: bytes) -> httpx.Response:
    return await client.post(path, content=content, headers={"content-type": "application/json"})


async def _normal(client: httpx.AsyncClient, rank: int, stream: bool) -> int:
    """Completion tokens of one greedy request on ``rank``."""
    body = {
        "text": f"normal {rank}",
        "routed_dp_rank": rank,
        "stream": stream,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 0},
    }
    if not stream:
        response = await _post(client, "/generate", json.dumps(body).encode())
        assert response.status_code == 200, response.text
        return response.json()["meta_info"]["completion_tokens"]
    last = None
    async with client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                last = json.loads(line[len("data: ") :])
    return last["meta_info"]["completion_tokens"]


def test_hostile_burst_loses_no_normal_request(server_dp2: ServerProcess) -> None:
    async def run() -> tuple[list[httpx.Response], list[int]]:
        async with httpx.AsyncClient(base_url=server_dp2.url, timeout=120) as client:
            hostile = [_post(client, path, body) for path, body in _hostile_bodies()]
            normal = [
                _normal(client, rank, stream=i % 2 == 1)
                for rank in (0, 1)
                for i in range(NORMAL_PER_RANK)
            ]
            results = await asyncio.gather(*normal, *hostile)
            return results[len(normal) :], results[: len(normal)]

    hostile, normal = asyncio.run(run())
    assert len(hostile) == HOSTILE_COUNT
    assert all(r.status_code == 400 for r in hostile), [
        (r.status_code, r.text[:200]) for r in hostile
    ]
    assert normal == [NEW_TOKENS] * (2 * NORMAL_PER_RANK)
    wait_idle(server_dp2)
    assert httpx.get(f"{server_dp2.url}/health").status_code == 200
    for rank in (0, 1):
        assert asyncio.run(_after(server_dp2, rank)) == NEW_TOKENS


async def _after(server: ServerProcess, rank: int) -> int:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        return await _normal(client, rank, stream=False)
