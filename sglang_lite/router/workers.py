"""Worker registry: physical servers, their (virtual) DP-rank workers, in-flight counters and breakers.

The router runs on one asyncio loop, so counters are plain ints: no locks, and no await between a
policy's selection and the increment that follows it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from .policies import WorkerState

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"


@dataclass
class CircuitBreaker:
    """Opens after `failure_threshold` consecutive failures; after `timeout_secs` lets probes through
    (half-open) and closes after `success_threshold` successes. Time is passed in."""

    failure_threshold: int = 10
    success_threshold: int = 3
    timeout_secs: float = 60.0
    enabled: bool = True
    state: str = CLOSED
    failures: int = 0
    successes: int = 0
    opened_at: float = 0.0

    def allows(self, now: float) -> bool:
        if not self.enabled or self.state == CLOSED:
            return True
        if self.state == OPEN and now - self.opened_at >= self.timeout_secs:
            self.state, self.successes = HALF_OPEN, 0
        return self.state == HALF_OPEN

    def record_success(self) -> None:
        self.failures = 0
        if self.state == HALF_OPEN:
            self.successes += 1
            if self.successes >= self.success_threshold:
                self.state = CLOSED

    def record_failure(self, now: float) -> None:
        self.failures += 1
        if self.state == HALF_OPEN or self.failures >= self.failure_threshold:
            self.state = OPEN
            self.opened_at = now
            self.failures = 0

    def reset(self) -> None:
        self.state = CLOSED
        self.failures = 0
        self.successes = 0


@dataclass
class Server:
    """One physical server (a base URL); health and breaker are shared by its DP ranks."""

    url: str
    dp_size: int | None  # None: not DP-aware, one worker addressed without a rank
    breaker: CircuitBreaker
    role: str = "regular"  # regular | prefill | decode
    bootstrap_port: int | None = None
    healthy: bool = True
    health_failures: int = 0
    health_successes: int = 0
    load_poll_failures: int = 0
    # its routing targets (one per DP rank)
    workers: list[Worker] = field(default_factory=list, repr=False)

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""


@dataclass
class Worker:
    """A routing target: a server, or one DP rank of it under --dp-aware."""

    server: Server
    dp_rank: int | None
    in_flight: int = 0
    polled_tokens: int | None = None
    selections: int = 0
    errors: int = 0
    sheds: int = 0  # 429/503 with Retry-After answered by the worker (its own load shedding)
    # A DP rank its server reports dead is skipped until this time (monotonic); the server stays in use.
    down_until: float = 0.0

    @property
    def url(self) -> str:
        return self.server.url if self.dp_rank is None else f"{self.server.url}@{self.dp_rank}"

    def rank_up(self, now: float) -> bool:
        return now >= self.down_until

    def mark_rank_down(self, now: float, for_secs: float = math.inf) -> None:
        """Skip this rank for `for_secs` (a health probe: until a probe sees it alive again)."""
        self.down_until = max(self.down_until, now + for_secs)

    def mark_rank_up(self) -> None:
        self.down_until = 0.0

    def view(self, now: float) -> WorkerState:
        healthy = self.server.healthy and self.rank_up(now) and self.server.breaker.allows(now)
        return WorkerState(self.url, self.dp_rank, healthy, self.in_flight, self.polled_tokens)

    def acquire(self) -> None:
        self.in_flight += 1
        self.selections += 1

    def release(self) -> None:
        assert self.in_flight > 0, f"in-flight underflow on {self.url}"
        self.in_flight -= 1

    def describe(self, now: float) -> dict:
        s = self.server
        return {
            "url": self.url,
            "base_url": s.url,
            "dp_rank": self.dp_rank,
            "role": s.role,
            "healthy": s.healthy,
            "rank_up": self.rank_up(now),
            "in_flight": self.in_flight,
            "polled_tokens": self.polled_tokens,
            "selections": self.selections,
            "errors": self.errors,
            "sheds": self.sheds,
            "breaker": s.breaker.state,
            "load_poll_failures": s.load_poll_failures,
        }


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


def expand(server: Server) -> list[Worker]:
    ranks = [None] if server.dp_size is None else range(server.dp_size)
    server.workers = [Worker(server, rank) for rank in ranks]
    return server.workers


@dataclass
class WorkerRegistry:
    """The servers of one role and their workers, in insertion order (the order policies see)."""

    servers: dict[str, Server] = field(default_factory=dict)
    workers: list[Worker] = field(default_factory=list)
    _by_url: dict[str, Worker] = field(default_factory=dict)

    def add(self, server: Server) -> list[Worker]:
        if server.url in self.servers:
            raise ValueError(f"worker {server.url} is already registered")
        self.servers[server.url] = server
        added = expand(server)
        self.workers.extend(added)
        self._by_url.update((w.url, w) for w in added)
        return added

    def remove(self, url: str) -> Server:
        server = self.servers.pop(normalize_url(url))  # KeyError: unknown worker
        self.workers = [w for w in self.workers if w.server is not server]
        self._by_url = {w.url: w for w in self.workers}
        return server

    def views(self, now: float) -> list[WorkerState]:
        return [w.view(now) for w in self.workers]

    def by_url(self, url: str) -> Worker:
        return self._by_url[url]

    def workers_of(self, server: Server) -> list[Worker]:
        return [w for w in self.workers if w.server is server]
