"""Periodic health checks with failure/success thresholds, one probe per physical server.

A server with several DP rank workers (--dp-aware) that fails its health check is asked about each rank
(`/v1/loads?include=core&dp_rank=N`). When some rank answers, the others are skipped until a later round sees
them answer (or the server's health check passes), so one dead rank takes out only itself. When no rank answers
the probe counts as the server's failure, judged by the failure threshold as before.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from .workers import Server

logger = logging.getLogger("sglang_lite.router")


def record_health(server: Server, ok: bool, failure_threshold: int, success_threshold: int) -> bool:
    """Apply one probe result; returns True when the server's healthy flag flipped."""
    if ok:
        server.health_failures, server.health_successes = 0, server.health_successes + 1
        flip = not server.healthy and server.health_successes >= success_threshold
    else:
        server.health_successes, server.health_failures = 0, server.health_failures + 1
        flip = server.healthy and server.health_failures >= failure_threshold
    if flip:
        server.healthy = not server.healthy
        if server.healthy:
            server.breaker.reset()  # a recovered server starts with a clean slate
    return flip


async def probe(session: aiohttp.ClientSession, url: str, endpoint: str, timeout: float) -> bool:
    try:
        async with session.get(
            url + endpoint, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            await resp.read()
            return resp.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False


class HealthChecker:
    def __init__(self, session: aiohttp.ClientSession, servers_fn, config) -> None:
        self.session = session
        self.servers_fn = servers_fn  # returns the current servers (they change with /add_worker)
        self.config = config

    async def run(self) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.health_check_interval_secs)
            await asyncio.gather(*(self.check(s) for s in list(self.servers_fn())))

    async def check(self, server: Server) -> None:
        cfg = self.config
        ok = await probe(
            self.session, server.url, cfg.health_check_endpoint, cfg.health_check_timeout_secs
        )
        if ok:
            for worker in server.workers:
                worker.mark_rank_up()
        elif any(w.dp_rank is not None for w in server.workers):
            ok = await self.check_ranks(server)  # degraded, not down, while some rank answers
        if record_health(server, ok, cfg.health_failure_threshold, cfg.health_success_threshold):
            logger.warning(
                "worker %s is now %s", server.url, "healthy" if server.healthy else "unhealthy"
            )

    async def check_ranks(self, server: Server) -> bool:
        """Probe each rank. True when any answers: then the silent ones are marked down and the others up. When none
        answers the server itself is failing, which its failure threshold judges (one slow round takes nothing out)."""
        timeout = self.config.health_check_timeout_secs
        ranks = [w for w in server.workers if w.dp_rank is not None]
        answers = await asyncio.gather(
            *(probe(self.session, server.url, rank_probe_path(w.dp_rank), timeout) for w in ranks)
        )
        if not any(answers):
            return False
        now = time.monotonic()
        for worker, up in zip(ranks, answers):
            if up:
                worker.mark_rank_up()
            elif worker.rank_up(now):
                logger.warning(
                    "DP rank %s of %s does not answer; skipping it", worker.dp_rank, server.url
                )
                worker.mark_rank_down(now)
        return True


def rank_probe_path(rank: int) -> str:
    return f"/v1/loads?include=core&dp_rank={rank}"
