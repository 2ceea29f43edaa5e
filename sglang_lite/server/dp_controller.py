"""The DP controller: which rank a request runs on.

A rank named by the request (``routed_dp_rank``, or the older ``data_parallel_rank``) wins; otherwise the
``--load-balance-method`` picks among live ranks. The choice is pure: it sees the live ranks and their in-flight
request counts (kept by the tokenizer manager from dispatch to the end of each request), nothing else.
"""

from __future__ import annotations

import itertools

from sglang_lite.server_args import LOAD_BALANCE_METHODS


class InvalidRank(ValueError):
    pass


def requested_rank(routed_dp_rank: int | None, data_parallel_rank: int | None) -> int | None:
    return routed_dp_rank if routed_dp_rank is not None else data_parallel_rank


class DPController:
    def __init__(self, dp_size: int, method: str) -> None:
        assert method in LOAD_BALANCE_METHODS, f"unknown load balance method {method!r}"
        self.dp_size, self.method = dp_size, method
        self._turns = itertools.count()

    def pick(self, requested: int | None, live: list[int], in_flight: list[int]) -> int:
        """The rank for one request; raises InvalidRank for a named rank that does not exist."""
        assert live, "no live rank"
        if requested is not None:
            if not 0 <= requested < self.dp_size:
                raise InvalidRank(f"routed_dp_rank must be in [0, {self.dp_size}), got {requested}")
            return requested
        if self.method == "round_robin":
            return live[next(self._turns) % len(live)]
        return min(live, key=lambda rank: (in_flight[rank], rank))
