from __future__ import annotations

import random
from typing import Sequence

from .base import Policy, RequestInfo, WorkerState, healthy_workers


class RandomPolicy(Policy):
    """A uniformly random healthy worker."""

    name = "random"

    def select(
        self, workers: Sequence[WorkerState], request: RequestInfo, rng: random.Random
    ) -> WorkerState | None:
        healthy = healthy_workers(workers)
        return rng.choice(healthy) if healthy else None
