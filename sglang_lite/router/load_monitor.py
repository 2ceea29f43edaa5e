"""Polls GET {base}/v1/loads?include=core once per physical server and stores num_total_tokens per rank."""
from __future__ import annotations

import asyncio
import logging

import aiohttp

from .workers import Server, Worker

logger = logging.getLogger("sglang_lite.router")


def parse_loads(payload: object) -> dict[int, int]:
    """Rank -> num_total_tokens. Missing, negative or duplicated ranks (and non-integer tokens) give no entry."""
    loads = payload.get("loads") if isinstance(payload, dict) else None
    if not isinstance(loads, list):
        return {}
    tokens: dict[int, int] = {}
    duplicated: set[int] = set()
    for entry in loads:
        rank, value = _rank_and_tokens(entry)
        if rank is None:
            continue
        if rank in tokens:
            duplicated.add(rank)
        tokens[rank] = value
    return {r: t for r, t in tokens.items() if r not in duplicated}


def _rank_and_tokens(entry: object) -> tuple[int | None, int]:
    if not isinstance(entry, dict):
        return None, 0
    rank, value = entry.get("dp_rank"), entry.get("num_total_tokens")
    valid = isinstance(rank, int) and rank >= 0 and isinstance(value, (int, float)) and not isinstance(value, bool)
    return (rank, int(value)) if valid else (None, 0)


def apply_loads(workers: list[Worker], tokens: dict[int, int] | None) -> None:
    """A DP-aware worker takes its rank's entry; a server-level worker (no rank) takes the sum over ranks."""
    for w in workers:
        if tokens is None or not tokens:
            w.polled_tokens = None
        elif w.dp_rank is None:
            w.polled_tokens = sum(tokens.values())
        else:
            w.polled_tokens = tokens.get(w.dp_rank)


async def fetch_loads(session: aiohttp.ClientSession, server: Server, timeout: float) -> dict[int, int] | None:
    try:
        async with session.get(f"{server.url}/v1/loads", params={"include": "core"},
                               timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                return None
            return parse_loads(await resp.json(content_type=None))
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None


class LoadMonitor:
    def __init__(self, session: aiohttp.ClientSession, registries, interval: float, timeout: float = 5.0) -> None:
        self.session = session
        self.registries = registries  # the registries whose policy needs loads
        self.interval = interval
        self.timeout = timeout
        self.polls = 0

    async def run(self) -> None:
        while True:  # first poll immediately
            await self.poll_once()
            await asyncio.sleep(self.interval)

    async def poll_once(self) -> None:
        pairs = [(reg, s) for reg in self.registries for s in list(reg.servers.values())]
        results = await asyncio.gather(*(fetch_loads(self.session, s, self.timeout) for _, s in pairs))
        for (reg, server), tokens in zip(pairs, results):
            apply_loads(reg.workers_of(server), tokens)
        self.polls += 1
