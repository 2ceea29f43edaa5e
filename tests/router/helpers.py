"""Client helpers for the router's end-to-end tests: bounded in count and time."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from dataclasses import dataclass

import aiohttp

from tests.tools.pd_faults import scheduler_pids, wait_for  # noqa: F401  (the tests import them from here)


@dataclass
class Result:
    status: int
    chunks: int = 0
    error: str | None = None  # transport error, or an SSE error event
    ttft: float | None = None
    elapsed: float = 0.0
    upstream: str | None = None  # the stand-in's X-Upstream-Name header
    body: dict | list | None = None  # a JSON response, or a stream's last JSON event
    retry_after: str | None = None  # the Retry-After header

    @property
    def model(self) -> str | None:
        """The served model name of an OpenAI response (the tests name each real server after itself)."""
        return self.body.get("model") if isinstance(self.body, dict) else None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


async def generate(
    session: aiohttp.ClientSession,
    url: str,
    route: str = "/generate",
    *,
    stream: bool = False,
    max_new_tokens: int = 4,
    text: str = "hello",
    timeout: float = 10.0,
    headers=None,
    first_event: asyncio.Event | None = None,
) -> Result:
    """``first_event``, if given, is set when a stream's first event arrives."""
    body = payload(route, stream, max_new_tokens, text)
    start = time.perf_counter()
    try:
        async with session.post(
            url + route, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            result = Result(
                resp.status,
                upstream=resp.headers.get("X-Upstream-Name"),
                retry_after=resp.headers.get("Retry-After"),
            )
            if stream and resp.status == 200:
                await read_events(resp, result, start, first_event)
            else:
                result.body = json_or_none(await resp.read())
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        result = Result(0, error=repr(exc))
    result.elapsed = time.perf_counter() - start
    return result


def chat_streams(
    session: aiohttp.ClientSession, url: str, count: int, max_new_tokens: int = 256
) -> list:
    """``count`` streamed chat completions started as tasks (a minute each at most)."""
    return [
        asyncio.create_task(
            generate(
                session,
                url,
                "/v1/chat/completions",
                stream=True,
                max_new_tokens=max_new_tokens,
                timeout=60,
            )
        )
        for _ in range(count)
    ]


async def read_events(
    resp: aiohttp.ClientResponse,
    result: Result,
    start: float,
    first_event: asyncio.Event | None = None,
) -> None:
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        if result.ttft is None:
            result.ttft = time.perf_counter() - start
            if first_event is not None:
                first_event.set()
        data = line[6:].strip()
        if data != b"[DONE]":
            result.body = json.loads(data)
            if "error" in result.body:
                result.error = result.body["error"]["message"]
        result.chunks += 1


def json_or_none(raw: bytes) -> dict | list | None:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def payload(route: str, stream: bool, max_new_tokens: int, text: str) -> dict:
    """Greedy, and ignore_eos so a real server generates exactly `max_new_tokens` tokens."""
    if route == "/generate":
        params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
        return {"text": text, "sampling_params": params, "stream": stream}
    common = {
        "model": "m",
        "max_tokens": max_new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if route == "/v1/chat/completions":
        return {"messages": [{"role": "user", "content": text}], **common}
    return {"prompt": text, **common}


def finish_reason(result: Result) -> str | None:
    """The finish reason of a /generate or OpenAI response (or of a stream's last event)."""
    body = result.body if isinstance(result.body, dict) else {}
    if "meta_info" in body:
        reason = body["meta_info"].get("finish_reason")
        return reason.get("type") if isinstance(reason, dict) else reason
    choices = body.get("choices") or [{}]
    return choices[0].get("finish_reason")


async def get_json(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
        return await resp.json()


async def get_text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
        return await resp.text()


def parse_counter(metrics: str, name: str, **labels: str) -> dict[str, float]:
    """Samples of Prometheus counter `name` whose labels include `labels`, keyed by their whole label text."""
    out = {}
    for line in metrics.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            key, value = line[len(name) + 1 :].rsplit("} ", 1)
            out[key] = float(value)
    return out


async def routed(session: aiohttp.ClientSession, server_url: str, **labels: str) -> dict[int, int]:
    """Requests a real server dispatched to each DP rank so far (its /metrics routing counters); how="named"
    counts only those whose body named the rank (routed_dp_rank), how="balanced" those it placed itself."""
    metrics = await get_text(session, server_url + "/metrics")
    counts: dict[int, int] = {}
    for key, n in parse_counter(metrics, "sglang_lite_requests_routed_total", **labels).items():
        rank = int(re.search(r'dp_rank="(\d+)"', key).group(1))
        counts[rank] = counts.get(rank, 0) + int(n)
    return counts


def delta(after: dict[int, int], before: dict[int, int]) -> dict[int, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


async def server_idle(session: aiohttp.ClientSession, server_url: str) -> bool:
    """Every rank of a real server holds no request and no KV tokens."""
    loads = (await get_json(session, server_url + "/v1/loads?include=core"))["loads"]
    return all(
        rank["num_running_reqs"] == rank["num_waiting_reqs"] == rank["num_total_tokens"] == 0
        for rank in loads
    )


async def in_flight(session: aiohttp.ClientSession, router_url: str) -> dict[str, int]:
    workers = (await get_json(session, router_url + "/workers"))["workers"]
    return {w["url"]: w["in_flight"] for w in workers}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))  # no test coroutine may run past a minute


@contextlib.contextmanager
def paused(pids: list[int]):
    """SIGSTOPs the processes for the block (far under --rank-hang-timeout-s) and always resumes them."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
