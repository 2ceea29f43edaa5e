"""Client helpers for the router's end-to-end tests: bounded in count and time."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp


@dataclass
class Result:
    status: int
    chunks: int = 0
    error: str | None = None  # transport error, or an SSE error event
    ttft: float | None = None
    elapsed: float = 0.0
    upstream: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


async def generate(session: aiohttp.ClientSession, url: str, route: str = "/generate", *, stream: bool = False,
                   max_new_tokens: int = 4, text: str = "hello", timeout: float = 10.0, headers=None) -> Result:
    body = payload(route, stream, max_new_tokens, text)
    start = time.perf_counter()
    try:
        async with session.post(url + route, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            result = Result(resp.status, upstream=resp.headers.get("X-Upstream-Name"))
            if stream and resp.status == 200:
                await read_events(resp, result, start)
            else:
                await resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        result = Result(0, error=repr(exc))
    result.elapsed = time.perf_counter() - start
    return result


async def read_events(resp: aiohttp.ClientResponse, result: Result, start: float) -> None:
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        if result.ttft is None:
            result.ttft = time.perf_counter() - start
        data = line[6:].strip()
        if data != b"[DONE]" and "error" in json.loads(data):
            result.error = json.loads(data)["error"]["message"]
        result.chunks += 1


def payload(route: str, stream: bool, max_new_tokens: int, text: str) -> dict:
    if route == "/generate":
        return {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}, "stream": stream}
    if route == "/v1/chat/completions":
        return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": max_new_tokens,
                "stream": stream}
    return {"model": "m", "prompt": text, "max_tokens": max_new_tokens, "stream": stream}


async def get_json(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
        return await resp.json()


async def in_flight(session: aiohttp.ClientSession, router_url: str) -> dict[str, int]:
    workers = (await get_json(session, router_url + "/workers"))["workers"]
    return {w["url"]: w["in_flight"] for w in workers}


async def wait_for(predicate, timeout: float, interval: float = 0.05) -> bool:
    """Poll an async predicate until true or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(interval)
    return await predicate()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))  # no test coroutine may run past a minute
