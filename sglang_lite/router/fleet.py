"""The worker fleet: which servers the router knows under each role, and how one joins or leaves.

A server joins once it answers its health check (and, under --dp-aware, reports its dp_size); it gets a circuit
breaker built from the config. The command-line workers join at start; the admin endpoints (/list_workers,
/add_worker, /remove_worker) list, add and remove servers while the router runs.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
from aiohttp import web

from .config import RouterConfig
from .health import probe
from .proxy import json_error
from .worker_urls import check_bootstrap_port, check_worker_url
from .workers import CircuitBreaker, Server, Worker, WorkerRegistry, normalize_url

logger = logging.getLogger("sglang_lite.router")

ROLES = ("regular", "prefill", "decode")


FIRST_PROBE_DELAY_S = 0.5
PROBE_BACKOFF = 1.5


class WorkerAuthError(ValueError):
    """A worker refused the router's key (401/403): a configuration error, not worth waiting for."""


class WorkerFleet:
    """Owns the per-role worker registries and the admin endpoints that change them.

    Probes and dp_size queries go over the session given to start(); the registries exist from construction, so
    policies and monitors can hold them before any server has joined.
    """

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.registries = {role: WorkerRegistry() for role in ROLES}
        self.session: aiohttp.ClientSession | None = None

    async def start(self, session: aiohttp.ClientSession) -> None:
        """Wait for the command-line workers and register them in command-line order, whichever answered first.

        Every URL is checked before any is waited for: a bad one raises WorkerUrlError at once."""
        self.session = session
        wanted = self._command_line_servers()
        tasks = [asyncio.ensure_future(self._ready_server(*w)) for w in wanted]
        try:
            servers = await asyncio.gather(*tasks)
        except BaseException:  # one worker failed: the others' probes stop too
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        for server in servers:
            self._register(server)

    def _command_line_servers(self) -> list[tuple[str, str, int | None]]:
        """(checked URL, role, bootstrap port) of each command-line worker."""
        cfg = self.config
        regular = [] if cfg.pd_disaggregation else cfg.worker_urls
        wanted = [(url, "regular", None) for url in regular]
        wanted += [(p.url, "prefill", p.bootstrap_port) for p in cfg.prefill]
        wanted += [(url, "decode", None) for url in cfg.decode]
        return [(check_worker_url(url), role, port) for url, role, port in wanted]

    def active_roles(self) -> tuple[str, ...]:
        return ("prefill", "decode") if self.config.pd_disaggregation else ("regular",)

    def all_servers(self) -> list[Server]:
        return [s for r in self.active_roles() for s in self.registries[r].servers.values()]

    def all_workers(self) -> list[Worker]:
        return [w for r in self.active_roles() for w in self.registries[r].workers]

    async def add_server(self, url: str, role: str, bootstrap_port: int | None = None) -> Server:
        """Wait for the server at ``url`` and register it. A URL the router refuses (WorkerUrlError) or
        one already registered under ``role`` raises a ValueError at once."""
        url = check_worker_url(url)
        if url in self.registries[role].servers:
            raise ValueError(f"worker {url} is already registered")
        server = await self._ready_server(url, role, bootstrap_port)
        self._register(server)
        return server

    async def _ready_server(self, url: str, role: str, bootstrap_port: int | None = None) -> Server:
        cfg = self.config
        url = normalize_url(url)
        dp_size = await self.wait_ready(url)
        breaker = CircuitBreaker(
            cfg.cb_failure_threshold,
            cfg.cb_success_threshold,
            cfg.cb_timeout_duration_secs,
            enabled=not cfg.disable_circuit_breaker,
        )
        return Server(url, dp_size, breaker, role, bootstrap_port)

    def _register(self, server: Server) -> None:
        self.registries[server.role].add(server)
        logger.info("added %s worker %s (dp_size=%s)", server.role, server.url, server.dp_size)

    async def wait_ready(self, url: str) -> int | None:
        """Wait until the server answers its health check (and, under --dp-aware, reports dp_size)."""
        cfg = self.config
        deadline = time.monotonic() + cfg.worker_startup_timeout_secs
        # probes every half second at first, backing off to --worker-startup-check-interval
        delay = min(FIRST_PROBE_DELAY_S, cfg.worker_startup_check_interval)
        while True:
            if await probe(
                self.session, url, cfg.health_check_endpoint, cfg.health_check_timeout_secs
            ):
                dp_size = await fetch_dp_size(self.session, url) if cfg.dp_aware else None
                if not cfg.dp_aware or dp_size is not None:
                    return dp_size
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"worker {url} did not become ready in {cfg.worker_startup_timeout_secs}s"
                )
            await asyncio.sleep(min(delay, max(deadline - time.monotonic(), 0.0)))
            delay = min(delay * PROBE_BACKOFF, cfg.worker_startup_check_interval)

    # ---- admin endpoints -------------------------------------------------------------------------------
    async def handle_list_workers(self, request: web.Request) -> web.Response:
        return web.json_response({"urls": [s.url for s in self.all_servers()]})

    async def handle_add_worker(self, request: web.Request) -> web.Response:
        url = request.query.get("url")
        role = request.query.get("role", "decode" if self.config.pd_disaggregation else "regular")
        if url is None or role not in self.active_roles():
            return json_error(400, f"need ?url=... and a role in {self.active_roles()}")
        try:
            port = check_bootstrap_port(request.query.get("bootstrap_port"))
            server = await self.add_server(url, role, port)
        except (ValueError, TimeoutError) as exc:  # WorkerAuthError, WorkerUrlError are ValueErrors
            return json_error(400, str(exc))
        return web.json_response({"added": server.url, "dp_size": server.dp_size, "role": role})

    async def handle_remove_worker(self, request: web.Request) -> web.Response:
        url = request.query.get("url", "")
        for role in self.active_roles():
            if normalize_url(url) in self.registries[role].servers:
                self.registries[role].remove(url)
                return web.json_response({"removed": normalize_url(url)})
        return json_error(404, f"no worker {url!r}")


async def fetch_dp_size(session: aiohttp.ClientSession, url: str) -> int | None:
    """dp_size from /server_info, falling back to /get_server_info (older servers); None when neither answers.

    Raises WorkerAuthError when the worker refuses the router's key, which waiting would not fix."""
    for path in ("/server_info", "/get_server_info"):
        try:
            async with session.get(url + path, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status in (401, 403):
                    raise WorkerAuthError(
                        f"worker {url} answered {resp.status} to {path}: the router's worker key "
                        "is missing or wrong (set --worker-api-key, default --api-key)"
                    )
                if resp.status == 200:
                    info = await resp.json(content_type=None)
                    return int(info.get("dp_size") or 1)
        except WorkerAuthError:
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            continue
    return None
