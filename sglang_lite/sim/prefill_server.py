"""A prefill server: one continuous-batching scheduler with chunked prefill and a prefix cache per prefix group.

Which waiting requests join a forward is decided by the engine scheduler's own `plan_prefill` (FCFS, token
budget, chunk size). Modelled instead: prefill memory is not limited (the prefill side frees a request's KV once
it is sent), and the prefix cache remembers, per prefix group, how many prompt tokens the last request of that
group left behind (LRU over groups, bounded in tokens), instead of a token-level radix tree.
"""

from __future__ import annotations

from collections import OrderedDict

from sglang_lite.scheduler.policy import PrefillBudget, plan_prefill
from sglang_lite.sim.sim_config import ClusterConfig, CostModel
from sglang_lite.sim.sim_request import SimRequest

UNLIMITED = 1 << 60


class PrefixCache:
    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
        self.groups: OrderedDict[str, int] = OrderedDict()
        self.tokens = 0

    def cached(self, group: str, prefix_len: int) -> int:
        if not group or group not in self.groups:
            return 0
        self.groups.move_to_end(group)
        return min(self.groups[group], prefix_len)

    def store(self, group: str, tokens: int) -> None:
        if not group:
            return
        self.tokens += tokens - self.groups.pop(group, 0)
        self.groups[group] = tokens
        while self.tokens > self.capacity and self.groups:
            _, dropped = self.groups.popitem(last=False)
            self.tokens -= dropped


class PrefillServer:
    def __init__(self, index: int, cost: CostModel, cluster: ClusterConfig) -> None:
        self.index = index
        self.cost = cost
        self.waiting: list[SimRequest] = []
        self.chunked: SimRequest | None = None
        self.cache = PrefixCache(cluster.prefill_cache_tokens)
        self.budget = PrefillBudget(
            kv_free=UNLIMITED,
            admit_free=UNLIMITED,
            batch_tokens=cluster.prefill_max_tokens,
            chunk_size=cluster.prefill_chunk_tokens,
            free_rows=UNLIMITED,
            new_token_ratio=1.0,
        )
        self.busy = False
        self.batch: list[tuple[SimRequest, int]] = []

    def enqueue(self, req: SimRequest) -> None:
        """The decode side has reserved memory (bootstrap done): the request may now be prefilled."""
        req.prefill_done = self.cache.cached(req.trace.prefix_group, req.trace.prefix_len)
        req.num_to_compute = req.input_len - req.prefill_done
        req.remaining_new_tokens = 1  # the prefill side produces only the first token
        self.waiting.append(req)

    def start_step(self) -> float | None:
        """Plans the next forward; returns its duration, or None when there is nothing to run."""
        plan = plan_prefill(self.chunked, self.waiting, self.budget)
        if not plan:
            return None
        admitted = sum(1 for r, _ in plan if r is not self.chunked)
        del self.waiting[:admitted]  # FCFS admission takes a prefix of the queue
        self.batch, self.busy = plan, True
        tokens = sum(n for _, n in plan)
        token_ctx = sum(n * (r.prefill_done + n // 2) for r, n in plan)
        return self.cost.prefill_s(tokens, token_ctx)

    def end_step(self) -> list[SimRequest]:
        """Applies the forward; returns the requests whose prompt is now fully prefilled."""
        done: list[SimRequest] = []
        self.chunked = None
        for req, n in self.batch:
            req.prefill_done += n
            req.num_to_compute = req.input_len - req.prefill_done
            if req.num_to_compute == 0:
                self.cache.store(req.trace.prefix_group, req.input_len)
                done.append(req)
            else:
                self.chunked = req
        self.batch, self.busy = [], False
        return done

    @property
    def queued(self) -> int:
        return len(self.waiting) + (self.chunked is not None)
