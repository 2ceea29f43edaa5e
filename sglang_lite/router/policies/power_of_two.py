"""Power of two choices, with the load metric of SGLANG_ROUTER_P2C_LOAD_METRIC (or --p2c-load-metric)."""

from __future__ import annotations

import random
from typing import Sequence

from sglang_lite import envs

from .base import Policy, RequestInfo, WorkerState, healthy_workers

LOAD_METRICS = ("tokens", "requests", "least_requests")


def resolve_load_metric(explicit: str | None) -> str:
    """The flag wins over the environment; an unknown name falls back to `tokens`, as upstream does."""
    name = explicit if explicit is not None else envs.SGLANG_ROUTER_P2C_LOAD_METRIC.get()
    name = name.strip().lower()
    return name if name in LOAD_METRICS else "tokens"


def _by_tokens(a: WorkerState, b: WorkerState) -> WorkerState:
    # Polled tokens decide only when both are known and differ; otherwise the live request count decides.
    if (
        a.polled_tokens is not None
        and b.polled_tokens is not None
        and a.polled_tokens != b.polled_tokens
    ):
        return a if a.polled_tokens < b.polled_tokens else b
    return b if b.in_flight < a.in_flight else a


def _by_requests(a: WorkerState, b: WorkerState) -> WorkerState:
    # Fewer in-flight requests wins even against a lower token load: DP ranks wait for the busiest batch.
    if a.in_flight != b.in_flight:
        return a if a.in_flight < b.in_flight else b
    if a.polled_tokens is not None and b.polled_tokens is not None:
        return b if b.polled_tokens < a.polled_tokens else a
    return a


def _least_requests(healthy: list[WorkerState], rng: random.Random) -> WorkerState:
    polled = [w for w in healthy if w.polled_tokens is not None]
    candidates = polled or healthy
    start = rng.randrange(len(candidates))  # a random start breaks ties randomly
    best = candidates[start]
    for i in range(1, len(candidates)):
        w = candidates[(start + i) % len(candidates)]
        if _load_key(w) < _load_key(best):
            best = w
    return best


def _load_key(w: WorkerState) -> tuple[int, int]:
    return (w.in_flight, w.polled_tokens or 0)


class PowerOfTwoPolicy(Policy):
    name = "power_of_two"
    needs_loads = True

    def __init__(self, load_metric: str | None = None) -> None:
        self.load_metric = resolve_load_metric(load_metric)

    def select(
        self, workers: Sequence[WorkerState], request: RequestInfo, rng: random.Random
    ) -> WorkerState | None:
        healthy = healthy_workers(workers)
        if len(healthy) <= 1:
            return healthy[0] if healthy else None
        if self.load_metric == "least_requests":
            return _least_requests(healthy, rng)
        a, b = rng.sample(healthy, 2)  # two distinct candidates
        return _by_requests(a, b) if self.load_metric == "requests" else _by_tokens(a, b)
