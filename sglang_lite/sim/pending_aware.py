"""A candidate decode balancing signal, `remaining`: in-flight requests weighted by how much decode is ahead.

Evaluated in the simulator only (see docs/balance.md): it did not lower the busiest rank's batch or TPOT against
`least_requests`, so it is not registered in the router. It is written as a pure policy over worker states, like
the router's, so registering it would be a one-line entry in the router's factory.

Why: under PD disaggregation a decode rank's in-flight requests are of two kinds. Requests still waiting for
their first token (in prefill, in the KV transfer or in the prealloc queue) will join the rank's running batch
and stay for their whole output; requests already decoding have on average half of theirs left and leave sooner.
Equal in-flight counts therefore do not mean equal batches over the next seconds. This metric counts a pending
request as 1 and a decoding one as `decoding_weight` (0.5 by default), then breaks ties on in-flight requests
and polled tokens, like `least_requests`, scanning from a random start.

Where the router would get it: both counts come from its own in-flight accounting, live: a request is pending from
dispatch until the first response bytes of the decode leg arrive (the decode server streams the first token once
the request joins its running batch), and decoding from then until the end of the response. No polling needed.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from sglang_lite.router.policies import Policy, RequestInfo, WorkerState, healthy_workers

DECODING_WEIGHT = 0.5


@dataclass(frozen=True)
class PhasedWorkerState(WorkerState):
    """A worker state that also says how many in-flight requests have not yet had a first token."""

    pending: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        assert 0 <= self.pending <= self.in_flight, f"pending requests outside in-flight on {self.url}"


def remaining_load(w: WorkerState, decoding_weight: float = DECODING_WEIGHT) -> tuple[float, int, int]:
    # Plain WorkerStates (no phase information) count every request as pending: the metric degrades to
    # least_requests instead of failing.
    pending = getattr(w, "pending", w.in_flight)
    return (pending + decoding_weight * (w.in_flight - pending), w.in_flight, w.polled_tokens or 0)


def least_remaining(healthy: Sequence[WorkerState], rng: random.Random,
                    decoding_weight: float = DECODING_WEIGHT) -> WorkerState:
    polled = [w for w in healthy if w.polled_tokens is not None]
    candidates = polled or list(healthy)
    start = rng.randrange(len(candidates))  # a random start breaks ties randomly
    best = candidates[start]
    best_key = remaining_load(best, decoding_weight)
    for i in range(1, len(candidates)):
        w = candidates[(start + i) % len(candidates)]
        key = remaining_load(w, decoding_weight)
        if key < best_key:
            best, best_key = w, key
    return best


class PendingAwarePolicy(Policy):
    """`least_requests` with pending requests counted 1 and decoding ones `decoding_weight`."""

    name = "remaining"
    needs_loads = True

    def __init__(self, decoding_weight: float = DECODING_WEIGHT) -> None:
        self.decoding_weight = decoding_weight

    def select(
        self, workers: Sequence[WorkerState], request: RequestInfo, rng: random.Random
    ) -> WorkerState | None:
        healthy = healthy_workers(workers)
        return least_remaining(healthy, rng, self.decoding_weight) if healthy else None
