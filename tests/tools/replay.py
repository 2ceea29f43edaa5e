"""Replays a trace against a server or router's `/generate`: closed loop (fixed concurrency) or by timestamp.

Closed loop keeps `concurrency` clients busy; each runs whole sessions, sending turn t+1 only after turn t ended,
as an agent does. Timestamp replay sends every request at its `arrival` time, whatever is still running.
Prompts are token ids drawn from a stream seeded by the prefix group, so a later turn of a session really repeats
its earlier prompt (prefix caches can hit). Every request asks for exactly `output_len` tokens (ignore_eos).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import zlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from sglang_lite.sim.traces import TraceRequest, group_sessions


@dataclass(frozen=True)
class RequestResult:
    request: TraceRequest
    ok: bool
    ttft: float
    latency: float
    output_tokens: int
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (
            (self.latency - self.ttft) / (self.output_tokens - 1)
            if self.ok and self.output_tokens > 1
            else None
        )


class PromptTokens:
    """Deterministic prompt ids: the first n tokens of a per-group stream (or per-session if no group)."""

    def __init__(self, vocab_size: int, low: int = 10) -> None:
        self.vocab_size, self.low = vocab_size, low
        self._streams: dict[str, list[int]] = {}

    def ids(self, r: TraceRequest) -> list[int]:
        key = r.prefix_group or f"{r.session}#{r.turn}"
        stream = self._streams.setdefault(key, [])
        if len(stream) < r.input_len:
            rng = random.Random(zlib.crc32(f"{key}:{len(stream)}".encode()))
            stream.extend(
                rng.randrange(self.low, self.vocab_size) for _ in range(r.input_len - len(stream))
            )
        return stream[: r.input_len]


def generate_body(r: TraceRequest, prompts: PromptTokens) -> dict:
    params = {
        "max_new_tokens": r.output_len,
        "min_new_tokens": r.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    return {"input_ids": prompts.ids(r), "sampling_params": params, "stream": True}


async def send_one(client, url: str, r: TraceRequest, prompts: PromptTokens) -> RequestResult:
    start = time.perf_counter()
    ttft, tokens = -1.0, 0
    try:
        async with client.stream("POST", f"{url}/generate", json=generate_body(r, prompts)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")[:200]
                return RequestResult(
                    r, False, 0.0, time.perf_counter() - start, 0, f"{resp.status_code} {body}"
                )
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                ttft = ttft if ttft >= 0 else time.perf_counter() - start
                tokens = max(tokens, _completion_tokens(line[5:]))
    except Exception as e:  # a failed request is a result, not a crash of the benchmark
        return RequestResult(r, False, 0.0, time.perf_counter() - start, 0, repr(e))
    return RequestResult(r, True, max(ttft, 0.0), time.perf_counter() - start, tokens)


def _completion_tokens(data: str) -> int:
    try:
        return int(json.loads(data).get("meta_info", {}).get("completion_tokens", 0))
    except (ValueError, AttributeError):
        return 0


async def replay_closed_loop(
    url: str,
    trace: Sequence[TraceRequest],
    concurrency: int,
    vocab_size: int,
    timeout: float = 600.0,
) -> list[RequestResult]:
    import httpx

    sessions = asyncio.Queue()
    for s in group_sessions(trace):
        sessions.put_nowait(s)
    prompts, results = PromptTokens(vocab_size), []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def agent() -> None:
            while not sessions.empty():
                for r in sessions.get_nowait():
                    results.append(await send_one(client, url, r, prompts))

        await asyncio.gather(*(agent() for _ in range(concurrency)))
    return results


async def replay_timestamps(
    url: str, trace: Sequence[TraceRequest], vocab_size: int, timeout: float = 600.0
) -> list[RequestResult]:
    import httpx

    prompts, start = PromptTokens(vocab_size), time.perf_counter()
    async with httpx.AsyncClient(
        timeout=timeout, limits=httpx.Limits(max_connections=None)
    ) as client:

        async def at_arrival(r: TraceRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, (r.arrival or 0.0) - (time.perf_counter() - start)))
            return await send_one(client, url, r, prompts)

        return list(await asyncio.gather(*(at_arrival(r) for r in trace)))


def summarize(results: Sequence[RequestResult], elapsed: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    tpots = [t for t in (r.tpot for r in ok) if t is not None] or [0.0]
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "output_tok_s": sum(r.output_tokens for r in ok) / max(elapsed, 1e-9),
        "ttft_p50_s": float(np.percentile([r.ttft for r in ok] or [0.0], 50)),
        "tpot_p50_s": float(np.percentile(tpots, 50)),
        "tpot_p90_s": float(np.percentile(tpots, 90)),
    }
