"""Prometheus text metrics: request counters, per-rank latency histograms, and per-rank load gauges taken live
at scrape time."""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from typing import Any

from sglang_lite.pd_transport.transfer import LATENCY_BUCKETS_S, SIZE_BUCKETS_BYTES

PREFIX = "sglang_lite"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# (sub-object of the rank's /v1/loads entry, or None for a core figure; figure)
LOAD_GAUGES = (
    (None, "num_running_reqs"),
    (None, "num_waiting_reqs"),
    (None, "num_used_tokens"),
    (None, "num_total_tokens"),
    (None, "token_usage"),
    (None, "gen_throughput"),
    (None, "utilization"),
    (None, "max_total_num_tokens"),
    ("memory", "snapshot_slots"),
    ("memory", "snapshot_slots_used"),
    # speculative decoding since start: tokens per verify step, accepted drafts over drafts (0 when off)
    ("speculative", "accept_length"),
    ("speculative", "accept_rate"),
)
# counters the ranks keep (PD disaggregation: what each rank sent or received through the transfer engine)
LOAD_COUNTERS = {  # metric: (sub-object, figure, help)
    "kv_transfers_total": (
        "disaggregation",
        "kv_transfers_total",
        "KV transfers of PD requests completed by each rank.",
    ),
    "kv_transfer_bytes_total": (
        "disaggregation",
        "kv_transfer_bytes_total",
        "Bytes of KV and GDN state moved by each rank's PD transfers.",
    ),
    "kv_transfer_seconds_total": (
        "disaggregation",
        "kv_transfer_seconds_total",
        "Seconds the PD transfers of each rank took.",
    ),
    "prefill_tokens_total": (
        "disaggregation",
        "num_prefill_tokens",
        "Tokens each rank ran through prefill forwards.",
    ),
    "cached_prompt_tokens_total": (
        None,
        "num_cached_prompt_tokens",
        "Prompt tokens each rank served from its prefix cache.",
    ),
    "snapshots_evicted_total": (
        "memory",
        "snapshots_evicted",
        "Prefix-cache GDN state snapshots each rank freed to make room for newer ones.",
    ),
}


def _figure(load: dict[str, Any], key: str | None, name: str) -> Any:
    return (load if key is None else load[key])[name]


# histograms the ranks keep (PD: one observation per request's transfer, figures of the entry's disaggregation
# sub-object): metric -> (counts figure, sum figure, bucket bounds, help)
LOAD_HISTOGRAMS = {
    "kv_transfer_latency_seconds": (
        "kv_transfer_latency_counts",
        "kv_transfer_seconds_total",
        LATENCY_BUCKETS_S,
        "Time of each PD request's KV and GDN-state transfer, as the prefill side timed its write.",
    ),
    "kv_transfer_size_bytes": (
        "kv_transfer_size_counts",
        "kv_transfer_bytes_total",
        SIZE_BUCKETS_BYTES,
        "Bytes of each PD request's KV and GDN-state transfer.",
    ),
}


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    @classmethod
    def of_counts(cls, buckets: tuple[float, ...], counts: list[int], total: float) -> Histogram:
        histogram = cls(buckets)
        histogram.counts = list(counts)
        histogram.sum = total
        return histogram

    def lines(self, name: str, labels: str) -> list[str]:
        out, cumulative = [], 0
        for bound, count in zip([*map(str, self.buckets), "+Inf"], self.counts):
            cumulative += count
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {cumulative}')
        return out + [
            f"{name}_sum{{{labels}}} {self.sum}",
            f"{name}_count{{{labels}}} {cumulative}",
        ]


class ServerMetrics:
    HISTOGRAMS = {
        "time_to_first_token_seconds": "Time from arrival to the first output token.",
        "inter_token_latency_seconds": "Time between output tokens of one request.",
        "e2e_request_latency_seconds": "Time from arrival to the end of a request.",
    }

    def __init__(self) -> None:
        self.http_requests: Counter[tuple[str, int]] = Counter()
        self.routed: Counter[tuple[int, str]] = Counter()  # (rank, "named" | "balanced")
        self.finished: Counter[tuple[int, str]] = Counter()  # (rank, finish reason)
        self.tokens: Counter[tuple[int, str]] = Counter()  # (rank, "prompt" | "generation")
        self.histograms: dict[str, defaultdict[int, Histogram]] = {
            n: defaultdict(Histogram) for n in self.HISTOGRAMS
        }

    def observe(self, name: str, rank: int, seconds: float) -> None:
        self.histograms[name][rank].observe(seconds)

    def render(self, loads: list[dict[str, Any]]) -> str:
        lines: list[str] = []
        self._counter(
            lines,
            "http_requests_total",
            "HTTP requests by route and status.",
            {f'route="{r}",status="{s}"': n for (r, s), n in self.http_requests.items()},
        )
        self._counter(
            lines,
            "requests_routed_total",
            "Requests dispatched to each rank; named: the request chose it.",
            {f'dp_rank="{r}",how="{h}"': n for (r, h), n in self.routed.items()},
        )
        self._counter(
            lines,
            "requests_finished_total",
            "Requests ended, by rank and finish reason.",
            {f'dp_rank="{r}",reason="{k}"': n for (r, k), n in self.finished.items()},
        )
        self._counter(
            lines,
            "tokens_total",
            "Prompt and generated tokens by rank.",
            {f'dp_rank="{r}",kind="{k}"': n for (r, k), n in self.tokens.items()},
        )
        for name, help_text in self.HISTOGRAMS.items():
            lines += [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} histogram"]
            for rank, histogram in sorted(self.histograms[name].items()):
                lines += histogram.lines(f"{PREFIX}_{name}", f'dp_rank="{rank}"')
        for key, gauge in LOAD_GAUGES:
            lines += [
                f"# HELP {PREFIX}_{gauge} Live {gauge} of each rank.",
                f"# TYPE {PREFIX}_{gauge} gauge",
            ]
            lines += [
                f'{PREFIX}_{gauge}{{dp_rank="{load["dp_rank"]}"}} {_figure(load, key, gauge)}'
                for load in loads
            ]
        for name, (key, figure, help_text) in LOAD_COUNTERS.items():
            self._counter(
                lines,
                name,
                help_text,
                {f'dp_rank="{load["dp_rank"]}"': _figure(load, key, figure) for load in loads},
            )
        return "\n".join(lines) + "\n" + self._histograms(loads)

    @staticmethod
    def _histograms(loads: list[dict[str, Any]]) -> str:
        """The histograms the ranks keep, from their bucket counts (ranks that keep none are left out)."""
        lines: list[str] = []
        for name, (counts, total, buckets, help_text) in LOAD_HISTOGRAMS.items():
            lines += [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} histogram"]
            for load in loads:
                pd = load.get("disaggregation") or {}
                if pd.get(counts):
                    histogram = Histogram.of_counts(buckets, pd[counts], pd[total])
                    lines += histogram.lines(f"{PREFIX}_{name}", f'dp_rank="{load["dp_rank"]}"')
        return "\n".join(lines) + "\n"

    @staticmethod
    def _counter(lines: list[str], name: str, help_text: str, values: dict[str, int]) -> None:
        lines += [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} counter"]
        lines += [f"{PREFIX}_{name}{{{labels}}} {n}" for labels, n in sorted(values.items())]
