"""Periodic health checks with failure/success thresholds, one probe per physical server."""
from __future__ import annotations

import asyncio
import logging

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
        async with session.get(url + endpoint, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
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
        ok = await probe(self.session, server.url, cfg.health_check_endpoint, cfg.health_check_timeout_secs)
        if record_health(server, ok, cfg.health_failure_threshold, cfg.health_success_threshold):
            logger.warning("worker %s is now %s", server.url, "healthy" if server.healthy else "unhealthy")
