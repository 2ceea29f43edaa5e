"""Candidate decode balancing signals, evaluated in the simulator only (see docs/balance.md). None lowered the
busiest rank's batch against `least_requests` by the 3% that would justify a new router metric, so none is
registered in the router. Each is a pure policy over worker states, like the router's.

Why they were tried: under PD disaggregation a decode rank's in-flight requests are of two kinds. Requests still
waiting for their first token (prealloc, prefill, KV transfer) will join the rank's running batch and stay for their
whole output; requests already decoding leave sooner. Equal in-flight counts therefore do not mean equal batches.
- `remaining`: pending + 0.5 x decoding (a decoding request has on average half its output left).
- `pending`: pending only (decoding requests will mostly be gone by the time a new one joins).
- `lr_pending`: `least_requests`, ties broken by fewer pending requests.
- `lasting` (oracle): pending + decoding requests with more than a typical wait (~1.7 s) of output left.
- `work_ahead` (oracle): the decode steps still ahead of the rank's in-flight requests.
The oracles read true output lengths; the router knows only max_new_tokens and the tokens streamed so far, so they
bound what a live estimate could do. The phase counts the router observes live: a request is pending from dispatch
until the first response bytes of the decode leg (the decode server streams the first token once the request joins
its batch), decoding from then until the end of the response.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

from sglang_lite.router.policies import Policy, RequestInfo, WorkerState, healthy_workers

DECODING_WEIGHT = 0.5


@dataclass(frozen=True)
class PhasedWorkerState(WorkerState):
    """A worker state that also says how many in-flight requests have not yet had a first token."""

    pending: int = 0
    # decode steps its in-flight requests still need (the `work_ahead` candidate)
    work_ahead: int = 0
    # in-flight requests that will be in the batch a wait from now (the `lasting` candidate)
    lasting: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        assert 0 <= self.pending <= self.in_flight, (
            f"pending requests outside in-flight on {self.url}"
        )
        assert self.work_ahead >= 0 and 0 <= self.lasting <= self.in_flight, (
            f"bad oracle counts on {self.url}"
        )


def least_by(
    healthy: Sequence[WorkerState], rng: random.Random, key: Callable[[WorkerState], tuple]
) -> WorkerState:
    """The candidate with the lowest key, among the polled ones (all when none is), scanning from a random start
    so that ties break randomly, like `least_requests`."""
    polled = [w for w in healthy if w.polled_tokens is not None]
    candidates = polled or list(healthy)
    start = rng.randrange(len(candidates))
    best = candidates[start]
    best_key = key(best)
    for i in range(1, len(candidates)):
        w = candidates[(start + i) % len(candidates)]
        w_key = key(w)
        if w_key < best_key:
            best, best_key = w, w_key
    return best


class LeastByPolicy(Policy):
    """Picks the rank with the lowest `key`; ties go on in-flight requests, then polled tokens. Plain
    WorkerStates (no phase information) count every request as pending, so a candidate degrades to
    least_requests instead of failing."""

    needs_loads = True

    def key(self, w: WorkerState) -> tuple:
        raise NotImplementedError

    def select(
        self, workers: Sequence[WorkerState], request: RequestInfo, rng: random.Random
    ) -> WorkerState | None:
        healthy = healthy_workers(workers)
        return least_by(healthy, rng, self.key) if healthy else None


def _pending(w: WorkerState) -> int:
    return getattr(w, "pending", w.in_flight)


class PendingAwarePolicy(LeastByPolicy):
    """Pending requests count 1, decoding ones `decoding_weight`."""

    name = "remaining"

    def __init__(self, decoding_weight: float = DECODING_WEIGHT) -> None:
        self.decoding_weight = decoding_weight

    def key(self, w: WorkerState) -> tuple:
        pending = _pending(w)
        return (
            pending + self.decoding_weight * (w.in_flight - pending),
            w.in_flight,
            w.polled_tokens or 0,
        )


class PendingOnlyPolicy(PendingAwarePolicy):
    """Decoding requests not counted: the rank with the fewest requests yet to join its batch."""

    name = "pending"

    def __init__(self) -> None:
        super().__init__(decoding_weight=0.0)


class PendingTieBreakPolicy(LeastByPolicy):
    """`least_requests` whose ties go to the rank with fewer requests yet to join its batch."""

    name = "lr_pending"

    def key(self, w: WorkerState) -> tuple:
        return (w.in_flight, _pending(w), w.polled_tokens or 0)


class LastingPolicy(LeastByPolicy):
    """Fewest requests that will still be in the batch when a new request would join it: pending ones, and
    decoding ones with more than a typical wait left (an oracle of output lengths)."""

    name = "lasting"

    def key(self, w: WorkerState) -> tuple:
        return (getattr(w, "lasting", 0), w.in_flight, w.polled_tokens or 0)


class WorkAheadPolicy(LeastByPolicy):
    """Fewest decode steps still ahead of the in-flight requests (an oracle of output lengths)."""

    name = "work_ahead"

    def key(self, w: WorkerState) -> tuple:
        return (getattr(w, "work_ahead", 0), w.in_flight, w.polled_tokens or 0)
