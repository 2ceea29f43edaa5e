"""The router: policies over the worker fleet behind an aiohttp server, forwarding with an aiohttp client."""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import hmac
import logging
import random
import sys
import time

import aiohttp
from aiohttp import web

from sglang_lite.utils.cli import listen

from .admission import Admission, Shed
from .config import RouterConfig
from .dashboard import ROUTES as DASHBOARD_ROUTES
from .dashboard import ClusterWatch, DashboardPage
from .dispatch import Dispatcher, rank_fields, record_outcome
from .fleet import WorkerAuthError, WorkerFleet, fetch_dp_size
from .health import HealthChecker
from .load_monitor import LoadMonitor
from .metrics import RouterMetrics
from .pd_router import PDForwarder
from .policies import Policy, RequestInfo, create_policy
from .proxy import (
    FIRST_EVENT_AT,
    UpstreamUnreachable,
    WorkerShed,
    backoff_secs,
    bearer,
    json_error,
    with_fields,
)
from .request_info import parse_body, request_info
from .workers import Server, Worker

logger = logging.getLogger("sglang_lite.router")

__all__ = ["Router", "WorkerAuthError", "fetch_dp_size", "key_matches", "serve"]

INFERENCE_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
OPEN_ROUTES = frozenset({"/health", "/liveness", "/readiness"})  # no API key needed


class Router:
    """Admission, policy choice and forwarding for inference requests, and the router's own endpoints.

    Which servers exist, and the admin endpoints that add and remove them, belong to `self.fleet`.
    """

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.metrics = RouterMetrics()
        self.admission = Admission(
            config.max_concurrent_requests, config.queue_size, config.queue_timeout_secs
        )
        self.fleet = WorkerFleet(config)
        self.registries = self.fleet.registries
        opts = config.policy_options()
        self.policies: dict[str, Policy] = {
            "regular": create_policy(config.policy, **opts),
            "prefill": create_policy(config.prefill_policy or config.policy, **opts),
            "decode": create_policy(config.decode_policy or config.policy, **opts),
        }
        # Opened by start(), on the running loop; the dispatcher and PD forwarder send over this session.
        self.session: aiohttp.ClientSession | None = None
        self.dispatcher: Dispatcher | None = None
        self.pd: PDForwarder | None = None  # only under --pd-disaggregation
        self.load_monitor: LoadMonitor | None = None
        # the live page's sampler (--dashboard-interval-secs > 0)
        self.dashboard: ClusterWatch | None = None
        if config.dashboard_interval_secs > 0:
            self.dashboard = ClusterWatch(
                config, self.all_servers, self.metrics, self._policy_names
            )
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        # The worker key rides on every call to workers: probes, dp_size, load polls (forwarded
        # requests set it too).
        key = self.config.worker_key
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, headers=bearer(key)
        )
        self.dispatcher = Dispatcher(self.session, self.config.request_timeout_secs, key)
        if self.config.pd_disaggregation:
            self.pd = PDForwarder(self.pick, self.dispatcher, self.rng)
        await self.fleet.start(self.session)
        self._start_monitors()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.pd is not None:
            await self.pd.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    def _start_monitors(self) -> None:
        cfg = self.config
        polled = [self.registries[r] for r in self.active_roles() if self.policies[r].needs_loads]
        if polled:  # loads are polled only when a power-of-two policy will read them
            self.load_monitor = LoadMonitor(self.session, polled, cfg.worker_startup_check_interval)
            self._tasks.append(asyncio.create_task(self.load_monitor.run()))
        if self.dashboard is not None:
            self._tasks.append(asyncio.create_task(self.dashboard.run(self.session)))
        if not cfg.disable_health_check:
            # per-rank probes for degraded servers
            checker = HealthChecker(self.session, self.all_servers, cfg)
            self._tasks.append(asyncio.create_task(checker.run()))

    # ---- workers (owned by the fleet) ------------------------------------------------------------------
    def active_roles(self) -> tuple[str, ...]:
        return self.fleet.active_roles()

    def all_servers(self) -> list[Server]:
        return self.fleet.all_servers()

    def all_workers(self) -> list[Worker]:
        return self.fleet.all_workers()

    async def add_server(self, url: str, role: str, bootstrap_port: int | None = None) -> Server:
        return await self.fleet.add_server(url, role, bootstrap_port)

    def pick(
        self, role: str, info: RequestInfo, exclude: frozenset[str] = frozenset()
    ) -> Worker | None:
        registry = self.registries[role]
        views = registry.views(time.monotonic())
        # servers that refused this request already: shown as unhealthy, so rings stay stable
        if exclude:
            views = [
                dataclasses.replace(v, healthy=False) if v.url in exclude else v for v in views
            ]
        chosen = self.policies[role].select(views, info, self.rng)
        return None if chosen is None else registry.by_url(chosen.url)

    # ---- forwarding ------------------------------------------------------------------------------------
    async def forward(
        self, request: web.Request, raw: bytes, info: RequestInfo
    ) -> web.StreamResponse:
        """Send to a chosen worker. A request that never reached one, or that one shed (nothing was sent to the
        client yet), is retried on another after a backoff; when none is left, the last shed answer goes back."""
        cfg = self.config
        retries = 0 if cfg.disable_retries else cfg.retry_max_retries
        refused: frozenset[str] = frozenset()
        shed: WorkerShed | None = None
        for attempt in range(retries + 1):
            worker = self.pick("regular", info, refused)
            if worker is None:
                break
            try:
                return await self.dispatcher.send(
                    request, worker, with_fields(raw, rank_fields(worker))
                )
            except UpstreamUnreachable as exc:
                logger.warning("worker %s unreachable: %s", worker.server.url, exc)
                record_outcome(worker, failed=True)
                refused |= {w.url for w in worker.server.workers}
            except WorkerShed as exc:
                # that rank is full (or dead); its siblings may not be
                shed, refused = exc, refused | {worker.url}
            if attempt < retries:
                self.metrics.retries += 1
                await asyncio.sleep(backoff_secs(attempt, cfg, self.rng))
        if shed is not None:
            return shed.response
        return json_error(503, "no healthy worker available", retry_after=1)

    # ---- handlers --------------------------------------------------------------------------------------
    async def handle_inference(self, request: web.Request) -> web.StreamResponse:
        start, status = time.perf_counter(), 500
        first_event = None
        try:
            async with self.admission.slot():
                resp = await self._route_inference(request)
            status = resp.status
            first_event = resp.get(FIRST_EVENT_AT)
            return resp
        except Shed as shed:
            self.metrics.shed[shed.status] += 1
            status = shed.status
            return json_error(shed.status, shed.reason, shed.retry_after)
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            ttft = None if first_event is None else first_event - start
            self.metrics.observe_request(request.path, status, time.perf_counter() - start, ttft)

    async def _route_inference(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = parse_body(raw)
        except ValueError as exc:
            return json_error(400, str(exc))
        info = request_info(body if self._needs_text() else None, request.headers)
        if self.config.pd_disaggregation:
            return await self.pd.forward(request, raw, body, info)
        return await self.forward(request, raw, info)

    def _needs_text(self) -> bool:
        return any(getattr(self.policies[r], "needs_text", False) for r in self.active_roles())

    async def handle_models(self, request: web.Request) -> web.StreamResponse:
        role = "decode" if self.config.pd_disaggregation else "regular"
        now = time.monotonic()
        worker = next((w for w in self.registries[role].workers if w.view(now).healthy), None)
        if worker is None:
            return json_error(503, "no healthy worker available", retry_after=1)
        try:
            return await self.dispatcher.send(request, worker, None)
        except WorkerShed as shed:
            return shed.response
        except UpstreamUnreachable as exc:
            record_outcome(worker, failed=True)
            return json_error(502, f"worker {worker.server.url} unreachable: {exc}")

    async def handle_workers(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        workers = [w.describe(now) for w in self.all_workers()]
        polls = self.load_monitor.polls if self.load_monitor else None
        return web.json_response(
            {"workers": workers, "policies": self._policy_names(), "load_polls": polls}
        )

    def _policy_names(self) -> dict[str, str]:
        out = {}
        for role in self.active_roles():
            p = self.policies[role]
            out[role] = p.name + (f":{p.load_metric}" if hasattr(p, "load_metric") else "")
        return out

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def handle_readiness(self, request: web.Request) -> web.Response:
        ready = any(s.healthy for s in self.all_servers())
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.render(self.all_workers()), content_type="text/plain")

    # ---- app -------------------------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._auth] if self.config.api_key else [],
            client_max_size=self.config.max_payload_size,
        )
        for path in INFERENCE_ROUTES:
            app.router.add_post(path, self.handle_inference)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/workers", self.handle_workers)
        app.router.add_get("/list_workers", self.fleet.handle_list_workers)
        app.router.add_post("/add_worker", self.fleet.handle_add_worker)
        app.router.add_post("/remove_worker", self.fleet.handle_remove_worker)
        for path, handler in (
            ("/health", self.handle_health),
            ("/liveness", self.handle_health),
            ("/readiness", self.handle_readiness),
            ("/metrics", self.handle_metrics),
        ):
            app.router.add_get(path, handler)
        if self.dashboard is not None:
            DashboardPage(self.dashboard).add_routes(app)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        """Every route but the open ones needs the key; the live page also takes it as a browser's Basic
        credentials (any user name, the key as password), so a browser can ask for it and send it again."""
        header, key = request.headers.get("Authorization"), self.config.api_key
        page = request.path in DASHBOARD_ROUTES
        if (
            request.path in OPEN_ROUTES
            or key_matches(header, key)
            or (page and basic_key_matches(header, key))
        ):
            return await handler(request)
        resp = json_error(401, "missing or wrong API key (Authorization: Bearer <key>)")
        resp.headers["WWW-Authenticate"] = 'Basic realm="sglang_lite router"' if page else "Bearer"
        return resp


def key_matches(header: str | None, key: str) -> bool:
    """Constant-time comparison of an Authorization header with `Bearer <key>`."""
    given = (header or "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, f"Bearer {key}".encode())


def basic_key_matches(header: str | None, key: str) -> bool:
    """Whether an Authorization header holds Basic credentials whose password is the key (constant-time)."""
    scheme, _, encoded = (header or "").partition(" ")
    if scheme.lower() != "basic":
        return False
    try:
        password = base64.b64decode(encoded.strip(), validate=True).partition(b":")[2]
    except (binascii.Error, ValueError):
        return False
    return hmac.compare_digest(password, key.encode())


async def serve(config: RouterConfig) -> None:
    """Run until cancelled: binds the port first (a port in use fails at once), waits for the workers, then
    serves; the line ``router listening on http://HOST:PORT`` says it is ready."""
    sock = listen(config.host, config.port)
    sock.setblocking(False)
    router = Router(config)
    runner = web.AppRunner(router.build_app(), handler_cancellation=True, access_log=None)
    try:
        await router.start()
        await runner.setup()
        await web.SockSite(runner, sock, backlog=2048).start()
        host, port = sock.getsockname()[:2]
        workers = len(router.all_servers())
        print(
            f"router listening on http://{host}:{port} ({workers} servers, policy {config.policy})",
            file=sys.stderr,
            flush=True,
        )
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await router.close()
        sock.close()
