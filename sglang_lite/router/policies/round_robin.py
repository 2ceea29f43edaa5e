from __future__ import annotations

import random
from typing import Sequence

from .base import Policy, RequestInfo, WorkerState, healthy_workers


class RoundRobinPolicy(Policy):
    """A counter modulo the number of healthy workers (the counter advances on every selection)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = 0

    def select(
        self, workers: Sequence[WorkerState], request: RequestInfo, rng: random.Random
    ) -> WorkerState | None:
        healthy = healthy_workers(workers)
        if not healthy:
            return None
        chosen = healthy[self._counter % len(healthy)]
        self._counter += 1
        return chosen
