"""Routing policies: pure objects that pick a worker from `WorkerState` snapshots."""

from __future__ import annotations

import inspect

from .base import Policy, RequestInfo, WorkerState, healthy_workers
from .cache_aware import CacheAwarePolicy, RadixTree
from .consistent_hashing import ConsistentHashingPolicy
from .power_of_two import LOAD_METRICS, PowerOfTwoPolicy, resolve_load_metric
from .random import RandomPolicy
from .round_robin import RoundRobinPolicy

POLICIES: dict[str, type[Policy]] = {
    "round_robin": RoundRobinPolicy,
    "random": RandomPolicy,
    "power_of_two": PowerOfTwoPolicy,
    "consistent_hashing": ConsistentHashingPolicy,
    "cache_aware": CacheAwarePolicy,
}


def create_policy(name: str, **opts) -> Policy:
    """Build a policy by name. Options a policy does not take are ignored, so one config can feed any policy."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}")
    cls = POLICIES[name]
    accepted = inspect.signature(cls).parameters
    return cls(**{k: v for k, v in opts.items() if k in accepted})


__all__ = [
    "Policy",
    "RequestInfo",
    "WorkerState",
    "healthy_workers",
    "create_policy",
    "POLICIES",
    "LOAD_METRICS",
    "RoundRobinPolicy",
    "RandomPolicy",
    "PowerOfTwoPolicy",
    "ConsistentHashingPolicy",
    "CacheAwarePolicy",
    "RadixTree",
    "resolve_load_metric",
]
