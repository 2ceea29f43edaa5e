"""Polls GET {base}/v1/loads?include=core once per physical server and stores num_total_tokens per rank.

A failed poll is counted on its server (`load_poll_failures`, in /metrics and /workers) and logged at most once
per LOG_EVERY_SECS per server. When the whole-server poll fails with an HTTP error (a dead rank makes it 503)
and the server has DP rank workers, each rank is polled alone (`&dp_rank=N`) so the live ranks keep their loads.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from .workers import Server, Worker

logger = logging.getLogger("sglang_lite.router")
LOG_EVERY_SECS = 60.0


class LoadPollError(Exception):
    """A /v1/loads poll that gave no loads; `http` is True when the server answered (with an error status)."""

    def __init__(self, message: str, http: bool = False) -> None:
        super().__init__(message)
        self.http = http


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
    valid = (
        isinstance(rank, int)
        and rank >= 0
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
    )
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


async def fetch_payload(
    session: aiohttp.ClientSession,
    server: Server,
    timeout: float,
    rank: int | None = None,
    include: str = "core",
) -> object:
    """The JSON of one server's `/v1/loads` (or of one of its ranks); raises LoadPollError."""
    params = {"include": include} | ({} if rank is None else {"dp_rank": str(rank)})
    try:
        async with session.get(
            f"{server.url}/v1/loads", params=params, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            if resp.status != 200:
                text = (await resp.text(errors="replace"))[:200]
                raise LoadPollError(f"HTTP {resp.status}: {text}", http=True)
            return await resp.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
        raise LoadPollError(repr(exc)) from exc


async def fetch_loads(
    session: aiohttp.ClientSession, server: Server, timeout: float, rank: int | None = None
) -> dict[int, int]:
    """Rank -> tokens of one server (or of one of its ranks); raises LoadPollError."""
    return parse_loads(await fetch_payload(session, server, timeout, rank))


async def fetch_rank_loads(
    session: aiohttp.ClientSession, server: Server, timeout: float
) -> dict[int, int]:
    """Each rank alone; the ranks that answer."""
    ranks = [w.dp_rank for w in server.workers if w.dp_rank is not None]
    results = await asyncio.gather(
        *(fetch_loads(session, server, timeout, r) for r in ranks), return_exceptions=True
    )
    return {r: t for res in results if isinstance(res, dict) for r, t in res.items()}


class LoadMonitor:
    def __init__(
        self, session: aiohttp.ClientSession, registries, interval: float, timeout: float = 5.0
    ) -> None:
        self.session = session
        self.registries = registries  # the registries whose policy needs loads
        self.interval = interval
        self.timeout = timeout
        self.polls = 0
        self._logged_at: dict[str, float] = {}  # server -> when its last failure was logged

    async def run(self) -> None:
        while True:  # first poll immediately
            await self.poll_once()
            await asyncio.sleep(self.interval)

    async def poll_once(self) -> None:
        pairs = [(reg, s) for reg in self.registries for s in list(reg.servers.values())]
        results = await asyncio.gather(*(self.poll_server(s) for _, s in pairs))
        for (reg, server), tokens in zip(pairs, results):
            apply_loads(reg.workers_of(server), tokens)
        self.polls += 1

    async def poll_server(self, server: Server) -> dict[int, int] | None:
        try:
            return await fetch_loads(self.session, server, self.timeout)
        except LoadPollError as exc:
            self.record_failure(server, exc)
            if exc.http and any(w.dp_rank is not None for w in server.workers):
                return await fetch_rank_loads(self.session, server, self.timeout)
            return None

    def record_failure(self, server: Server, exc: LoadPollError) -> None:
        server.load_poll_failures += 1
        now = time.monotonic()
        if now - self._logged_at.get(server.url, -LOG_EVERY_SECS) >= LOG_EVERY_SECS:
            self._logged_at[server.url] = now
            logger.warning(
                "load poll of %s failed (%d failures so far; logged at most every %.0f s): %s",
                server.url,
                server.load_poll_failures,
                LOG_EVERY_SECS,
                exc,
            )
