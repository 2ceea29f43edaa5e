"""The load figures a rank reports, in the field names and the shape of SGLang's ``/v1/loads``.

A rank's entry holds the core figures flat and every other section as a nested sub-object, present when its
``include`` name is asked for and null otherwise, as upstream::

    {"dp_rank": 0, "timestamp": ..., "num_running_reqs": 3, ..., "memory": {"weight_gb": ...}, "speculative": null,
     "lora": null, "disaggregation": {"mode": "decode", ...}, "queues": {"waiting": 0, ...}}

``SECTIONS`` below is the one place that says which figure goes where: adding a figure to a section is one line
there (and one field of ``SchedulerLoads``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

# include name -> (the sub-object's key in a rank's entry, or None for the flat core figures; its figures). A figure
# is a SchedulerLoads attribute named as in the entry, or a pair (name in the entry, attribute) where the two differ.
SECTIONS: dict[str, tuple[str | None, tuple[str | tuple[str, str], ...]]] = {
    "core": (
        None,
        (
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
    ),
    "memory": (
        "memory",
        (
            "weight_gb",
            "kv_cache_gb",
            "graph_gb",
            "token_capacity",
            "snapshot_slots",
            "snapshot_slots_used",
            "snapshots_evicted",
        ),
    ),
    "spec": ("speculative", ("accept_length", "accept_rate")),
    "lora": (
        "lora",
        (
            ("slots_used", "lora_slots_used"),
            ("slots_total", "lora_slots_total"),
            ("utilization", "lora_utilization"),
        ),
    ),
    "disagg": (
        "disaggregation",
        (
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
    ),
    "queues": ("queues", ("waiting", "grammar", "paused", "retracted", "num_retractions")),
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
    grammar: int = 0  # waiting for their grammar to compile
    graph_gb: float = (
        0.0  # CUDA graphs of decode (or speculative) steps (0 where none are captured)
    )
    # speculative decoding since start (zero when off): tokens per verify step of a request (accepted drafts
    # plus the corrected or bonus token), accepted drafts over drafts
    accept_length: float = 0.0
    accept_rate: float = 0.0
    # LoRA adapters: none here, so upstream's section reads zero
    lora_slots_used: int = 0
    lora_slots_total: int = 0
    lora_utilization: float = 0.0
    # KV slots the prefix cache holds (those no request uses count as free, not used)
    cached_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache since start
    # the prefix cache's GDN state snapshots: slots in all, in use, and freed for newer ones since start
    snapshot_slots: int = 0
    snapshot_slots_used: int = 0
    snapshots_evicted: int = 0
    # prefill/decode disaggregation (``scheduler/pd_side/``): "null" serves whole requests, every queue empty
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
        """The rank's entry: the core figures flat, each section of ``include`` as its sub-object, the others
        null (core figures are always there, as upstream's)."""
        values = dataclasses.asdict(self)
        entry = _figures(values, SECTIONS["core"][1])
        for name, (key, figures) in SECTIONS.items():
            if key is not None:
                entry[key] = _figures(values, figures) if name in include else None
        return entry


def _figures(values: dict[str, Any], figures: tuple[str | tuple[str, str], ...]) -> dict[str, Any]:
    pairs = [(f, f) if isinstance(f, str) else f for f in figures]
    return {name: values[attribute] for name, attribute in pairs}


def section(entry: dict[str, Any], key: str) -> dict[str, Any]:
    """A rank entry's sub-object ``key`` ("memory", "disaggregation", ...); empty when it was not asked for."""
    return entry.get(key) or {}


def utc_timestamp() -> str:
    return datetime.now(timezone.utc).isoformat()
