"""A hash ring with 150 virtual nodes per worker; the key comes from request headers."""

from __future__ import annotations

import bisect
import hashlib
import random
from typing import Sequence

from .base import Policy, RequestInfo, WorkerState, healthy_workers

VIRTUAL_NODES = 150
TARGET_WORKER_HEADER = "x-smg-target-worker"
# Key headers in priority order; the first one present is hashed.
KEY_HEADERS = ("x-smg-routing-key", "authorization", "x-forwarded-for", "cookie")


def ring_hash(key: str) -> int:
    # A stable hash (unlike Python's salted hash()) so the ring is the same in every process.
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


def routing_key(headers: dict[str, str] | object) -> str | None:
    for name in KEY_HEADERS:
        value = headers.get(name)  # type: ignore[attr-defined]
        if value:
            return value
    return None


class HashRing:
    """Sorted virtual-node hashes of a fixed set of worker urls."""

    def __init__(self, urls: Sequence[str], virtual_nodes: int = VIRTUAL_NODES) -> None:
        self.urls = tuple(sorted(urls))
        nodes = sorted(
            (ring_hash(f"{url}#{i}"), url) for url in self.urls for i in range(virtual_nodes)
        )
        self._hashes = [h for h, _ in nodes]
        self._owners = [u for _, u in nodes]

    def walk(self, key: str):
        """Worker urls clockwise from the key's position, each url once."""
        if not self._hashes:
            return
        start = bisect.bisect_left(self._hashes, ring_hash(key))
        seen: set[str] = set()
        for i in range(len(self._owners)):
            url = self._owners[(start + i) % len(self._owners)]
            if url not in seen:
                seen.add(url)
                yield url


class ConsistentHashingPolicy(Policy):
    """`bounded_load` (e.g. 1.5) spills a key to the next node when its worker holds more than that multiple of
    the average in-flight count of the healthy workers; None disables the bound."""

    name = "consistent_hashing"

    def __init__(
        self, bounded_load: float | None = None, virtual_nodes: int = VIRTUAL_NODES
    ) -> None:
        assert bounded_load is None or bounded_load >= 1.0, (
            "a load bound below 1.0 would reject every worker"
        )
        self.bounded_load = bounded_load
        self.virtual_nodes = virtual_nodes
        self._ring = HashRing((), virtual_nodes)

    def select(
        self, workers: Sequence[WorkerState], request: RequestInfo, rng: random.Random
    ) -> WorkerState | None:
        healthy = healthy_workers(workers)
        if not healthy:
            return None
        target = _direct_target(workers, request)
        if target is not None:
            return target
        key = routing_key(request.headers)
        if key is None:
            return rng.choice(healthy)
        return self._walk(workers, healthy, key)

    def _walk(
        self, workers: Sequence[WorkerState], healthy: list[WorkerState], key: str
    ) -> WorkerState:
        self._ensure_ring(workers)
        by_url = {w.url: w for w in healthy}
        limit = self._load_limit(healthy)
        first_healthy = None
        for url in self._ring.walk(key):
            w = by_url.get(url)
            if w is None:
                continue
            first_healthy = first_healthy or w
            if limit is None or w.in_flight <= limit:
                return w
        # every healthy worker is over the bound: keep the key's home
        return first_healthy or healthy[0]

    def _load_limit(self, healthy: list[WorkerState]) -> float | None:
        if self.bounded_load is None:
            return None
        return self.bounded_load * sum(w.in_flight for w in healthy) / len(healthy)

    def _ensure_ring(self, workers: Sequence[WorkerState]) -> None:
        # The ring holds all workers, healthy or not, so a worker's keys come back to it when it recovers.
        urls = tuple(sorted(w.url for w in workers))
        if urls != self._ring.urls:
            self._ring = HashRing(urls, self.virtual_nodes)


def _direct_target(workers: Sequence[WorkerState], request: RequestInfo) -> WorkerState | None:
    """X-SMG-Target-Worker names a worker by index; an invalid or unhealthy target falls through to hashing."""
    raw = request.headers.get(TARGET_WORKER_HEADER)
    if raw is None or not raw.strip().isdigit():
        return None
    index = int(raw)
    if index < len(workers) and workers[index].healthy:
        return workers[index]
    return None
