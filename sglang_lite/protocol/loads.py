"""The load figures a rank reports, in the field names of SGLang's ``/v1/loads``, and their sections."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

SECTIONS = {
    "core": (
        "dp_rank",
        "timestamp",
        "num_running_reqs",
        "num_waiting_reqs",
        "num_used_tokens",
        "num_total_tokens",
        "max_total_num_tokens",
        "token_usage",
        "gen_throughput",
        "cache_hit_rate",
        "utilization",
        "max_running_requests",
        "cached_tokens",
        "num_cached_prompt_tokens",
    ),
    "memory": (
        "weight_gb",
        "kv_cache_gb",
        "token_capacity",
        "snapshot_slots",
        "snapshot_slots_used",
        "snapshots_evicted",
    ),
    "disagg": (
        "mode",
        "prefill_prealloc_queue_reqs",
        "prefill_inflight_queue_reqs",
        "decode_prealloc_queue_reqs",
        "decode_transfer_queue_reqs",
        "decode_retracted_queue_reqs",
        "kv_transfer_speed_gb_s",
        "kv_transfer_latency_ms",
        "kv_transfers_in_flight",
        "kv_transfers_total",
        "kv_transfer_bytes_total",
        "kv_transfer_seconds_total",
        "kv_transfer_latency_counts",
        "kv_transfer_size_counts",
        "num_prefill_tokens",
    ),
    "queues": ("waiting", "paused", "retracted"),
}
LOAD_SECTIONS = tuple(SECTIONS)  # every section, the default wherever loads are asked for


@dataclass(frozen=True)
class SchedulerLoads:
    dp_rank: int
    timestamp: str
    num_running_reqs: int  # requests holding memory: decoding, or mid chunked prefill
    num_waiting_reqs: int
    num_used_tokens: int  # KV slots held
    # used + tokens still to prefill (waiting requests, the rest of a chunked prompt)
    num_total_tokens: int
    max_total_num_tokens: int
    token_usage: float  # used / max
    gen_throughput: float  # generated tokens/s over the recent window
    # prompt tokens served from the prefix cache / prompt tokens admitted, since start
    cache_hit_rate: float
    utilization: float  # running / max_running_requests
    max_running_requests: int
    weight_gb: float
    kv_cache_gb: float  # KV pool plus linear-attention state pool
    token_capacity: int
    waiting: int
    paused: int
    retracted: int  # waiting requests that were retracted at least once
    num_retractions: int  # retractions since start
    # KV slots the prefix cache holds (those no request uses count as free, not used)
    cached_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache since start
    # the prefix cache's GDN state snapshots: slots in all, in use, and freed for newer ones since start
    snapshot_slots: int = 0
    snapshot_slots_used: int = 0
    snapshots_evicted: int = 0
    # prefill/decode disaggregation (``scheduler/disagg.py``): "null" serves whole requests, every queue empty
    mode: str = "null"
    # waiting for the decode side's destination (SGLang's bootstrap queue)
    prefill_prealloc_queue_reqs: int = 0
    # prefilled, their KV and state being written to the decode side
    prefill_inflight_queue_reqs: int = 0
    decode_prealloc_queue_reqs: int = 0  # waiting for KV slots and a state slot to reserve
    decode_transfer_queue_reqs: int = 0  # reserved, waiting for the prefill side's data
    decode_retracted_queue_reqs: int = 0
    # moving averages over the recent transfers written (prefill) or received (decode), as the prefill side timed
    # them: bytes over seconds, mean seconds
    kv_transfer_speed_gb_s: float = 0.0
    kv_transfer_latency_ms: float = 0.0
    kv_transfers_in_flight: int = (
        0  # prefill: writes not done; decode: reservations awaiting their data
    )
    kv_transfers_total: int = 0
    kv_transfer_bytes_total: int = 0
    kv_transfer_seconds_total: float = 0.0
    kv_transfer_latency_counts: list[int] = dataclasses.field(default_factory=list)  # per bucket
    kv_transfer_size_counts: list[int] = dataclasses.field(default_factory=list)  # per bucket
    num_prefill_tokens: int = 0  # tokens run through prefill forwards since start

    def to_dict(self, include: tuple[str, ...] = LOAD_SECTIONS) -> dict[str, Any]:
        """The named sections' figures, always with ``dp_rank`` and ``timestamp``."""
        names = ["dp_rank", "timestamp"] + [n for section in include for n in SECTIONS[section]]
        names += ["num_retractions"] if "queues" in include else []
        values = dataclasses.asdict(self)
        return {n: values[n] for n in dict.fromkeys(names)}


def utc_timestamp() -> str:
    return datetime.now(timezone.utc).isoformat()
