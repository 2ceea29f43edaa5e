"""The rank's load figures (``/v1/loads``): what its queues, memory and PD side hold, and the throughput meter
behind ``gen_throughput``."""

from __future__ import annotations

import collections
from dataclasses import dataclass

from sglang_lite.mem_cache.request_memory import RequestMemory
from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.protocol.loads import SchedulerLoads, utc_timestamp

GB = 1024**3


class ThroughputMeter:
    """Tokens per second over the last ``window_s`` seconds (or since ``start``, if that is more recent).

    Time is passed in, so the figure is testable and the meter holds no clock of its own.
    """

    def __init__(self, start: float, window_s: float = 10.0) -> None:
        self.start = start
        self.window_s = window_s
        self._events: collections.deque[tuple[float, int]] = collections.deque()

    def record(self, now: float, tokens: int) -> None:
        self._events.append((now, tokens))
        self._trim(now)

    def rate(self, now: float) -> float:
        self._trim(now)
        span = min(self.window_s, now - self.start)
        return sum(n for _, n in self._events) / span if span > 0 else 0.0

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()


@dataclass
class LoadInputs:
    """What the scheduler's owners know at the moment loads are asked for."""

    running: int  # requests holding memory (decoding or mid chunked prefill)
    waiting: int  # in the waiting queue
    retracted: int  # of those, retracted at least once
    compiling: int  # waiting for their grammar
    tokens_to_prefill: int
    pd_waiting: int  # in the PD queues, not decoding yet
    pd_waiting_tokens: int  # prompt tokens of those that hold no memory yet
    num_retractions: int
    num_prefill_tokens: int
    cache_hit_rate: float
    prompt_tokens_cached: int
    gen_throughput: float
    # speculative decoding since start: tokens per verify step, accepted drafts over drafts (0 when off)
    accept_length: float = 0.0
    accept_rate: float = 0.0


def report_loads(
    config: SchedulerConfig,
    memory: RequestMemory,
    weight_bytes: int,
    inputs: LoadInputs,
    mode: str,
    pd: dict,
    graph_bytes: int = 0,
) -> SchedulerLoads:
    # unused cached prefixes are free space, as upstream counts them
    used = memory.used_tokens
    total = config.max_total_tokens
    pools = memory.pools
    return SchedulerLoads(
        dp_rank=config.dp_rank,
        timestamp=utc_timestamp(),
        num_running_reqs=inputs.running,
        num_waiting_reqs=inputs.waiting + inputs.pd_waiting + inputs.compiling,
        num_used_tokens=used,
        # PD: a reserved request's KV is in `used` already; one still in prealloc counts its prompt
        num_total_tokens=used + inputs.tokens_to_prefill + inputs.pd_waiting_tokens,
        max_total_num_tokens=total,
        token_usage=used / total,
        gen_throughput=inputs.gen_throughput,
        cache_hit_rate=inputs.cache_hit_rate,
        cached_tokens=memory.cached_tokens,
        num_cached_prompt_tokens=inputs.prompt_tokens_cached,
        utilization=inputs.running / config.max_running_requests,
        max_running_requests=config.max_running_requests,
        weight_gb=weight_bytes / GB,
        graph_gb=graph_bytes / GB,
        kv_cache_gb=(pools.kv.bytes + pools.states.bytes) / GB,
        token_capacity=total,
        snapshot_slots=pools.states.snapshots.size,
        snapshot_slots_used=pools.states.snapshots.num_used,
        snapshots_evicted=memory.cache.snapshots_evicted if memory.cache is not None else 0,
        waiting=inputs.waiting,
        grammar=inputs.compiling,
        paused=0,
        retracted=inputs.retracted,
        num_retractions=inputs.num_retractions,
        num_prefill_tokens=inputs.num_prefill_tokens,
        accept_length=inputs.accept_length,
        accept_rate=inputs.accept_rate,
        mode=mode,
        decode_retracted_queue_reqs=inputs.retracted if pd else 0,
        **pd,
    )
