"""The router in virtual time: the real policy objects, real in-flight accounting and a stale load monitor.

What matches the HTTP router (sglang_lite.router): the policies are the same objects built by `create_policy`;
in-flight counts rise at dispatch and fall when the response ends; polled tokens are `num_total_tokens` as of the
last poll (every `poll_interval_s`, the first at time 0). In PD mode prefill and decode workers are chosen
independently, each side by its own policy; decode workers are DP-aware (`url@rank`).
Additionally it counts, per decode rank, the in-flight requests still waiting for their first token, which is
what the candidate `remaining` signal reads (`PhasedWorkerState.pending`, see pending_aware.py).
"""

from __future__ import annotations

import random
from typing import Callable

from sglang_lite.router.policies import Policy, RequestInfo, WorkerState, create_policy
from sglang_lite.sim.pending_aware import (
    LastingPolicy,
    PendingAwarePolicy,
    PendingOnlyPolicy,
    PendingTieBreakPolicy,
    PhasedWorkerState,
    WorkAheadPolicy,
)

PLAIN_POLICIES = ("round_robin", "random")
EMPTY_REQUEST = RequestInfo()
# Policies the simulator knows that the router does not (candidates, test fixtures): label -> factory.
EXTRA_POLICIES: dict[str, Callable[[], Policy]] = {
    p.name: p
    for p in (
        PendingAwarePolicy,
        PendingOnlyPolicy,
        WorkAheadPolicy,
        PendingTieBreakPolicy,
        LastingPolicy,
    )
}
PHASED_POLICIES = (PendingAwarePolicy, WorkAheadPolicy, PendingTieBreakPolicy, LastingPolicy)


def make_policy(label: str) -> Policy:
    """A compare label -> the router's policy: a plain policy by name, anything else a power-of-two metric."""
    if label in PLAIN_POLICIES:
        return create_policy(label)
    if label in EXTRA_POLICIES:
        return EXTRA_POLICIES[label]()
    policy = create_policy("power_of_two", load_metric=label)
    # resolve_load_metric silently falls back to `tokens`; a typo must not measure the wrong policy
    assert getattr(policy, "load_metric", None) == label, f"unknown load metric {label!r}"
    return policy


class SimRouter:
    def __init__(
        self,
        decode_policy: str,
        prefill_policy: str,
        num_prefill: int,
        decode_ranks: list[tuple[int, int]],
        seed: int,
    ) -> None:
        """`decode_ranks`: (server, rank) of every decode DP rank, in the order policies see them."""
        self.decode_policy = make_policy(decode_policy)
        self.prefill_policy = make_policy(prefill_policy)
        self.rng = random.Random(seed)
        self.decode_urls = [f"http://decode{s}@{r}" for s, r in decode_ranks]
        self.prefill_urls = [f"http://prefill{i}" for i in range(num_prefill)]
        self.in_flight = [0] * len(decode_ranks)
        self.pending = [0] * len(decode_ranks)
        self.polled: list[int | None] = [None] * len(decode_ranks)
        self.prefill_in_flight = [0] * num_prefill
        self._decode_index = {u: i for i, u in enumerate(self.decode_urls)}
        self._prefill_index = {u: i for i, u in enumerate(self.prefill_urls)}
        self.polls = 0
        # the cluster sets it
        self.work_ahead: Callable[[], list[int]] = lambda: [0] * len(self.decode_urls)
        # the cluster sets it
        self.lasting: Callable[[], list[int]] = lambda: [0] * len(self.decode_urls)

    def dispatch(self) -> tuple[int, int]:
        """(prefill server, global decode rank) for a new request; counts it in flight on both."""
        p = self._pick(self.prefill_policy, self._prefill_views(), self._prefill_index)
        d = self._pick(self.decode_policy, self._decode_views(), self._decode_index)
        self.prefill_in_flight[p] += 1
        self.in_flight[d] += 1
        self.pending[d] += 1
        return p, d

    def _pick(self, policy: Policy, views: list[WorkerState], index: dict[str, int]) -> int:
        chosen = policy.select(views, EMPTY_REQUEST, self.rng)
        assert chosen is not None, "every simulated worker is healthy"
        return index[chosen.url]

    def _decode_views(self) -> list[WorkerState]:
        # Only the candidate metrics read the phase; plain states are cheaper to build for the others.
        if isinstance(self.decode_policy, PHASED_POLICIES):
            ahead, lasting = self.work_ahead(), self.lasting()
            return [
                PhasedWorkerState(
                    u,
                    i,
                    True,
                    self.in_flight[i],
                    self.polled[i],
                    self.pending[i],
                    ahead[i],
                    lasting[i],
                )
                for i, u in enumerate(self.decode_urls)
            ]
        return [
            WorkerState(u, i, True, self.in_flight[i], self.polled[i])
            for i, u in enumerate(self.decode_urls)
        ]

    def _prefill_views(self) -> list[WorkerState]:
        return [
            WorkerState(u, None, True, self.prefill_in_flight[i])
            for i, u in enumerate(self.prefill_urls)
        ]

    def on_prefill_done(self, prefill: int) -> None:
        # The prefill leg's response ends when its prompt is processed.
        self.prefill_in_flight[prefill] -= 1

    def on_first_token(self, rank: int) -> None:
        self.pending[rank] -= 1

    def on_finish(self, rank: int) -> None:
        assert self.in_flight[rank] > 0, "in-flight underflow"
        self.in_flight[rank] -= 1

    def poll(self, num_total_tokens: list[int]) -> None:
        """The load monitor: every decode rank's num_total_tokens as of now (stale until the next poll)."""
        self.polled = list(num_total_tokens)
        self.polls += 1
