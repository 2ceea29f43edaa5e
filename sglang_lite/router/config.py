"""Router configuration: one frozen dataclass; argparse takes its defaults from it.

Flag names follow sglang-router's common ones, so a launch line for it works here unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from sglang_lite.utils.cli import OneLineParser

from .policies import LOAD_METRICS, POLICIES
from .worker_urls import WorkerUrlError, check_bootstrap_port, check_worker_url


@dataclass(frozen=True)
class PrefillSpec:
    url: str
    bootstrap_port: int | None = None


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    worker_urls: tuple[str, ...] = ()
    policy: str = "cache_aware"
    dp_aware: bool = False
    # None: read SGLANG_ROUTER_P2C_LOAD_METRIC when the policy is created
    p2c_load_metric: str | None = None
    # consistent_hashing load bound (e.g. 1.5); None: unbounded
    bounded_load_factor: float | None = None
    # cache_aware
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 2**26
    # workers and loads
    worker_startup_timeout_secs: float = 1800.0
    worker_startup_check_interval: float = 30.0  # also the /v1/loads polling period
    # admission
    max_concurrent_requests: int = -1  # -1: unlimited
    queue_size: int = 100
    queue_timeout_secs: float = 60.0
    request_timeout_secs: float = 1800.0
    max_payload_size: int = 512 * 1024 * 1024
    # clients must send it (Bearer) on every route but /health, /liveness, /readiness
    api_key: str | None = None
    # The key the router sends to workers (its own calls and forwarded requests). None: --api-key; "": none.
    worker_api_key: str | None = None
    # health checks
    health_check_interval_secs: float = 60.0
    health_check_timeout_secs: float = 5.0
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    health_check_endpoint: str = "/health"
    disable_health_check: bool = False
    # circuit breaker
    cb_failure_threshold: int = 10
    cb_success_threshold: int = 3
    cb_timeout_duration_secs: float = 60.0
    disable_circuit_breaker: bool = False
    # retries (only for requests that never reached a worker)
    retry_max_retries: int = 5
    retry_initial_backoff_ms: float = 50.0
    retry_max_backoff_ms: float = 30000.0
    retry_backoff_multiplier: float = 1.5
    retry_jitter_factor: float = 0.2
    disable_retries: bool = False
    # PD disaggregation
    pd_disaggregation: bool = False
    prefill: tuple[PrefillSpec, ...] = ()
    decode: tuple[str, ...] = ()
    prefill_policy: str | None = None
    decode_policy: str | None = None
    # the live cluster page (GET /dashboard, its data at /dashboard/data): every server's /v1/loads sampled this
    # often (0: no page, no sampling); balance figures and latency percentiles over the last window; charts keep
    # the history
    dashboard_interval_secs: float = 1.0
    dashboard_window_secs: float = 60.0
    dashboard_history_secs: float = 300.0
    log_level: str = "info"
    seed: int | None = None  # seeds the router's RNG (tests); None: fresh entropy

    def __post_init__(self) -> None:
        for name in (self.policy, self.prefill_policy, self.decode_policy):
            assert name is None or name in POLICIES, f"unknown policy {name!r}"
        assert self.p2c_load_metric is None or self.p2c_load_metric in LOAD_METRICS
        assert self.dashboard_interval_secs >= 0, "--dashboard-interval-secs must be >= 0"
        assert self.dashboard_window_secs > 0 and self.dashboard_history_secs > 0

    @property
    def worker_key(self) -> str | None:
        return self.api_key if self.worker_api_key is None else (self.worker_api_key or None)

    def policy_options(self) -> dict:
        return dict(
            load_metric=self.p2c_load_metric,
            bounded_load=self.bounded_load_factor,
            cache_threshold=self.cache_threshold,
            balance_abs_threshold=self.balance_abs_threshold,
            balance_rel_threshold=self.balance_rel_threshold,
            max_tree_size=self.max_tree_size,
        )


_DEFAULTS = RouterConfig()
_CHOICES = {
    "policy": sorted(POLICIES),
    "prefill_policy": sorted(POLICIES),
    "decode_policy": sorted(POLICIES),
    "p2c_load_metric": list(LOAD_METRICS),
    "log_level": ["debug", "info", "warn", "warning", "error"],
}
_SPECIAL = {"worker_urls", "prefill", "decode", "seed"}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m sglang_lite.router", description="sglang_lite router")
    for f in dataclasses.fields(RouterConfig):
        if f.name not in _SPECIAL:
            _add_field(parser, f)
    parser.add_argument("--worker-urls", nargs="*", default=[], help="worker base URLs")
    parser.add_argument(
        "--prefill",
        nargs="+",
        action="append",
        default=[],
        metavar="URL [BOOTSTRAP_PORT]",
        help="a prefill worker and optionally its bootstrap port (repeatable)",
    )
    parser.add_argument(
        "--decode", action="append", default=[], metavar="URL", help="a decode worker (repeatable)"
    )
    parser.add_argument("--seed", type=int, default=None, help="seed for the router's RNG")
    return parser


def _add_field(parser: argparse.ArgumentParser, f: dataclasses.Field) -> None:
    flag = "--" + f.name.replace("_", "-")
    default = getattr(_DEFAULTS, f.name)
    if isinstance(default, bool):
        parser.add_argument(flag, action="store_true", default=default)
        return
    kind = _field_type(f)
    parser.add_argument(
        flag, type=kind, default=default, choices=_CHOICES.get(f.name), help=f"default: {default}"
    )


def _field_type(f: dataclasses.Field):
    text = str(f.type)
    for name, kind in (("float", float), ("int", int)):
        if text.startswith(name):
            return kind
    return str


def parse_prefill(entries: list[list[str]]) -> tuple[PrefillSpec, ...]:
    """Raises WorkerUrlError for an entry that is not URL [BOOTSTRAP_PORT] or has a bad port."""
    specs = []
    for entry in entries:
        if not 1 <= len(entry) <= 2:
            raise WorkerUrlError(f"--prefill takes URL [BOOTSTRAP_PORT], got {entry}")
        port = entry[1] if len(entry) == 2 else None
        try:
            port = None if port in ("none", "None") else check_bootstrap_port(port)
        except WorkerUrlError as error:
            raise WorkerUrlError(f"--prefill {' '.join(entry)}: {error}") from None
        specs.append(PrefillSpec(entry[0], port))
    return tuple(specs)


def check_worker_flags(config: RouterConfig) -> None:
    """Raises WorkerUrlError, naming the flag, for the first worker URL the router would refuse."""
    flags = (
        ("--worker-urls", config.worker_urls),
        ("--prefill", [p.url for p in config.prefill]),
        ("--decode", config.decode),
    )
    for flag, urls in flags:
        for url in urls:
            try:
                check_worker_url(url)
            except WorkerUrlError as error:
                raise WorkerUrlError(f"{flag}: {error}") from None


def config_from_args(argv: list[str] | None = None) -> RouterConfig:
    """Bad worker URLs and bootstrap ports are argparse errors (one line, exit status 2)."""
    parser = build_parser()
    ns = vars(parser.parse_args(argv))
    ns["worker_urls"] = tuple(ns["worker_urls"])
    ns["decode"] = tuple(ns["decode"])
    ns["log_level"] = "warning" if ns["log_level"] == "warn" else ns["log_level"]
    try:
        ns["prefill"] = parse_prefill(ns["prefill"])
        config = RouterConfig(**ns)
        check_worker_flags(config)
    except WorkerUrlError as error:
        parser.error(str(error))
    return config
