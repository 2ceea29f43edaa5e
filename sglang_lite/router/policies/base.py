"""The policy interface: worker states in, a choice out.

Policies are pure: no HTTP, no clocks, no global state. The HTTP router and the simulator hand them the same
`WorkerState` snapshots, so what the simulator shows is what the router does.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Mapping, Sequence


@dataclass(frozen=True)
class WorkerState:
    """A snapshot of one (virtual) worker as a policy sees it."""

    url: str  # "http://host:port" or, under --dp-aware, "http://host:port@rank"
    dp_rank: int | None = None
    healthy: bool = True
    in_flight: int = 0
    # num_total_tokens from /v1/loads; None when not polled or missing
    polled_tokens: int | None = None

    def __post_init__(self) -> None:
        assert self.in_flight >= 0, f"negative in-flight count for {self.url}"


@dataclass(frozen=True)
class RequestInfo:
    """What a policy may look at in a request: the prompt text and the (lower-cased) headers."""

    text: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)


class Policy(ABC):
    """Chooses one healthy worker; returns None when no worker is healthy."""

    name: str = ""
    needs_loads: bool = False  # whether the load monitor must poll /v1/loads for this policy
    needs_text: bool = False  # whether the router must extract the prompt text for this policy

    @abstractmethod
    def select(
        self, workers: Sequence[WorkerState], request: RequestInfo, rng: random.Random
    ) -> WorkerState | None: ...


def healthy_workers(workers: Sequence[WorkerState]) -> list[WorkerState]:
    return [w for w in workers if w.healthy]
