"""Prometheus text exposition, written by hand so the router needs no client library."""

from __future__ import annotations

import bisect
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Iterable

from .workers import CLOSED, HALF_OPEN, OPEN, Worker

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)
BREAKER_VALUE = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}
RECENT_REQUESTS = 4096  # the live page's latency percentiles read at most the newest this many


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def lines(self, name: str, labels: str) -> list[str]:
        out, cumulative = [], 0
        for bound, count in zip(self.buckets + (float("inf"),), self.counts):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {cumulative}')
        out.append(f"{name}_sum{{{labels}}} {self.total}")
        out.append(f"{name}_count{{{labels}}} {cumulative}")
        return out


@dataclass
class RouterMetrics:
    requests: Counter = field(default_factory=Counter)  # (route, status) -> count
    # route -> seconds to the end of the body
    latency: dict[str, Histogram] = field(default_factory=dict)
    retries: int = 0
    shed: Counter = field(default_factory=Counter)  # status (429/503) -> count
    # the newest requests: (monotonic end, seconds to the end of the body, seconds to the first streamed event or
    # None when nothing was streamed)
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_REQUESTS))

    def observe_request(
        self, route: str, status: int, seconds: float, ttft: float | None = None
    ) -> None:
        self.requests[(route, status)] += 1
        self.latency.setdefault(route, Histogram()).observe(seconds)
        self.recent.append((time.monotonic(), seconds, ttft))

    def render(self, workers: Iterable[Worker]) -> str:
        lines = _worker_lines(list(workers))
        lines += _family(
            "sglang_router_requests_total",
            "counter",
            "requests by route and status",
            [f'route="{r}",status="{s}"' for r, s in self.requests],
            list(self.requests.values()),
        )
        lines += ["# TYPE sglang_router_request_duration_seconds histogram"]
        for route, hist in self.latency.items():
            lines += hist.lines("sglang_router_request_duration_seconds", f'route="{route}"')
        lines += _family(
            "sglang_router_retries_total",
            "counter",
            "retries on another worker",
            [""],
            [self.retries],
        )
        lines += _family(
            "sglang_router_shed_total",
            "counter",
            "requests shed by admission control",
            [f'status="{s}"' for s in self.shed],
            list(self.shed.values()),
        )
        return "\n".join(lines) + "\n"


def _worker_lines(workers: list[Worker]) -> list[str]:
    labels = [f'worker="{w.url}"' for w in workers]
    now = time.monotonic()
    servers = list({id(w.server): w.server for w in workers}.values())
    return (
        _family(
            "sglang_router_worker_in_flight",
            "gauge",
            "requests in flight",
            labels,
            [w.in_flight for w in workers],
        )
        + _family(
            "sglang_router_worker_selections_total",
            "counter",
            "times chosen",
            labels,
            [w.selections for w in workers],
        )
        + _family(
            "sglang_router_worker_errors_total",
            "counter",
            "failed dispatches",
            labels,
            [w.errors for w in workers],
        )
        + _family(
            "sglang_router_worker_sheds_total",
            "counter",
            "429/503 with Retry-After from the worker",
            labels,
            [w.sheds for w in workers],
        )
        + _family(
            "sglang_router_worker_healthy",
            "gauge",
            "1 when its server is healthy and its DP rank up",
            labels,
            [int(w.server.healthy and w.rank_up(now)) for w in workers],
        )
        + _family(
            "sglang_router_worker_breaker_state",
            "gauge",
            "0 closed, 1 half-open, 2 open",
            labels,
            [BREAKER_VALUE[w.server.breaker.state] for w in workers],
        )
        + _family(
            "sglang_router_worker_polled_tokens",
            "gauge",
            "num_total_tokens from /v1/loads",
            [lab for lab, w in zip(labels, workers) if w.polled_tokens is not None],
            [w.polled_tokens for w in workers if w.polled_tokens is not None],
        )
        + _family(
            "sglang_router_load_poll_failures_total",
            "counter",
            "failed /v1/loads polls per server",
            [f'worker="{s.url}"' for s in servers],
            [s.load_poll_failures for s in servers],
        )
    )


def _family(name: str, kind: str, help_text: str, labels: list[str], values: list) -> list[str]:
    out = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    out += [f"{name}{{{lab}}} {v}" if lab else f"{name} {v}" for lab, v in zip(labels, values)]
    return out
