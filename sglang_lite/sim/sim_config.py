"""Simulator configuration: a cost model and a cluster shape (from a JSON file), and one run's settings."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from sglang_lite.sim.traces import AgenticTraceConfig

DEFAULT_CLUSTER_FILE = Path(__file__).with_name("default_cluster.json")


@dataclass(frozen=True)
class CostModel:
    """Seconds per forward. Prefill: base + per token + attention over the context each new token sees.
    A decode rank's step: base + per running request + per KV token it reads; a server's step is its slowest
    rank's (DP attention: the ranks meet in the MoE all-to-all every layer)."""

    prefill_base_s: float
    prefill_per_token_s: float
    prefill_per_token_ctx_s: float
    decode_base_s: float
    decode_per_req_s: float
    decode_per_kv_token_s: float
    transfer_latency_s: float
    transfer_bandwidth_bytes_s: float
    kv_bytes_per_token: int
    # One request's KV moves at most this fast however idle the link is (per-request transfer engine rate);
    # transfers run in parallel up to the link's bandwidth. 0: no per-request limit.
    transfer_request_bytes_s: float = 0.0

    def rank_step_s(self, batch: int, kv_tokens: int) -> float:
        return (
            self.decode_base_s
            + self.decode_per_req_s * batch
            + self.decode_per_kv_token_s * kv_tokens
        )

    def prefill_s(self, tokens: int, token_ctx: int) -> float:
        """`token_ctx`: sum over the batch's new tokens of the context length each attends to."""
        return (
            self.prefill_base_s
            + self.prefill_per_token_s * tokens
            + self.prefill_per_token_ctx_s * token_ctx
        )

    def transfer_s(self, tokens: int) -> float:
        """Wire time only; the latency is added once per request."""
        return tokens * self.kv_bytes_per_token / self.transfer_bandwidth_bytes_s

    def transfer_request_s(self, tokens: int) -> float:
        """The shortest time one request's KV can take, set by the per-request rate (0 when unlimited)."""
        rate = self.transfer_request_bytes_s
        return tokens * self.kv_bytes_per_token / rate if rate > 0 else 0.0


@dataclass(frozen=True)
class ClusterConfig:
    num_prefill: int = 1
    num_decode: int = 1
    decode_dp_size: int = 8
    gpus_per_server: int = 8
    rank_kv_tokens: int = 1_500_000  # KV pool of one decode rank
    rank_max_running: int = 128  # request rows of one decode rank
    prefill_max_tokens: int = 16384  # tokens in one prefill forward
    prefill_chunk_tokens: int = 8192  # tokens of one request in one prefill forward
    # prefix cache of one prefill server (LRU over prefix groups)
    prefill_cache_tokens: int = 20_000_000
    poll_interval_s: float = 1.0  # the router's /v1/loads polling period (loads are this stale)
    sample_interval_s: float = 1.0  # the balance sampler's period

    def __post_init__(self) -> None:
        assert self.num_prefill > 0 and self.num_decode > 0 and self.decode_dp_size > 0, (
            "empty cluster"
        )
        assert self.prefill_chunk_tokens <= self.prefill_max_tokens, (
            "a chunk must fit one prefill forward"
        )

    @property
    def num_gpus(self) -> int:
        return (self.num_prefill + self.num_decode) * self.gpus_per_server


def load_cluster_file(path: str | Path | None = None) -> tuple[CostModel, ClusterConfig]:
    with open(path or DEFAULT_CLUSTER_FILE) as f:
        data = json.load(f)
    return CostModel(**data["cost"]), ClusterConfig(**data.get("cluster", {}))


def load_trace_config(path: str | Path | None = None) -> AgenticTraceConfig:
    """The agentic trace shape the cluster file's `trace` section sets (the generator's defaults elsewhere)."""
    with open(path or DEFAULT_CLUSTER_FILE) as f:
        return AgenticTraceConfig(**json.load(f).get("trace", {}))


def save_cluster_file(
    path: str | Path,
    cost: CostModel,
    cluster: ClusterConfig,
    comment: str = "",
    trace: AgenticTraceConfig | None = None,
) -> None:
    data = {
        "_comment": comment,
        "cost": dataclasses.asdict(cost),
        "cluster": dataclasses.asdict(cluster),
    }
    if trace is not None:
        data["trace"] = dataclasses.asdict(trace)
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


@dataclass(frozen=True)
class SimConfig:
    """One run. `policy` is a compare label: round_robin | random | tokens | requests | least_requests | any
    other power-of-two load metric. `duration_s=None` runs a finite trace (`max_sessions`) to completion."""

    policy: str = "least_requests"
    # Not round_robin: two round-robin counters advancing together alias (with decode ranks a multiple of the
    # prefill servers, rank k always shares prefill server k mod P), see docs/balance.md.
    prefill_policy: str = "requests"
    concurrency: int = 256
    duration_s: float | None = 3600.0
    warmup_s: float = 300.0  # excluded from every metric
    seed: int = 0
    max_sessions: int | None = None
    cost: CostModel = field(default_factory=lambda: load_cluster_file()[0])
    cluster: ClusterConfig = field(default_factory=lambda: load_cluster_file()[1])
    trace: AgenticTraceConfig = field(default_factory=load_trace_config)
    # assert memory limits after every step (slower; tests turn it on)
    check_invariants: bool = False

    def __post_init__(self) -> None:
        assert self.concurrency > 0, "concurrency must be positive"
        assert self.duration_s is not None or self.max_sessions is not None, (
            "an endless trace needs a duration"
        )
