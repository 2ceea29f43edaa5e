"""DP-rank balance as the upstream p2c study measures it, over samples of every rank's ``/v1/loads`` entry.

One implementation for the benchmark sampler (``sim/balance_sampling.py``), the simulator and the router's live page
(``router/dashboard/``), so that their figures agree. Plain Python, no numpy: the router imports it and must start
fast.

Why these numbers: under DP attention a decode step lasts as long as its busiest rank, so the busiest rank's
running batch and the spread of per-rank request counts decide TPOT, while KV tokens mostly decide memory.

Definitions (series are [samples][ranks]; a sample is one poll of every rank):
- outstanding = running + waiting (whose count includes a PD rank's prealloc, transfer and retracted queues, as
  SGLang's does) + a prefill rank's inflight queue (requests still being sent).
- CV: per sample, population std over ranks / mean over ranks; averaged over samples whose mean is > 0.
- busiest batch: mean over samples of the maximum running batch over ranks.
- busiest/mean KV: mean over samples (with KV > 0) of max over ranks / mean over ranks of KV tokens.
- rank batch ratio: each rank's mean running batch / the mean over all ranks.
- busiest share: the share of samples in which each rank holds the largest running batch (ties split evenly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from sglang_lite.protocol.loads import section

Series = Sequence[Sequence[float]]


@dataclass(frozen=True)
class BalanceStats:
    outstanding_cv: float
    running_cv: float
    busiest_batch: float
    busiest_over_mean_kv: float
    rank_batch_ratio: tuple[float, ...]
    busiest_share: tuple[float, ...]
    num_samples: int
    poll_failures: int = 0  # polls of a server that gave nothing (each leaves a gap in the series)

    def row(self) -> dict[str, float]:
        return {
            "outstanding_cv": self.outstanding_cv,
            "running_cv": self.running_cv,
            "busiest_batch": self.busiest_batch,
            "busiest_over_mean_kv": self.busiest_over_mean_kv,
        }


def outstanding_of(entry: dict[str, Any]) -> int:
    """A rank's requests not finished yet, from its ``/v1/loads`` entry (the PD queues in its ``disaggregation``
    sub-object; absent when that section was not asked for)."""
    inflight = section(entry, "disaggregation").get("prefill_inflight_queue_reqs", 0) or 0
    return (
        int(entry.get("num_running_reqs", 0))
        + int(entry.get("num_waiting_reqs", 0))
        + int(inflight)
    )


def _rows(series: Series) -> list[list[float]]:
    return [[float(x) for x in row] for row in series]


def _std(row: list[float]) -> float:
    mean = sum(row) / len(row)
    return math.sqrt(sum((x - mean) ** 2 for x in row) / len(row))


def _mean_over_samples(
    series: Series, spread: Callable[[list[float]], float], empty: float
) -> float:
    """Mean over samples of ``spread(row) / mean(row)`` across ranks; all-zero samples are skipped (``empty`` when
    every sample is)."""
    ratios = [spread(row) / (sum(row) / len(row)) for row in _rows(series) if sum(row) > 0]
    return sum(ratios) / len(ratios) if ratios else empty


def mean_cv(series: Series) -> float:
    """Mean over samples of the across-rank coefficient of variation; samples with an all-zero row are skipped."""
    return _mean_over_samples(series, _std, 0.0)


def busiest_over_mean(series: Series) -> float:
    """Mean over samples of the busiest rank's value over the ranks' mean; 1 when nothing was ever loaded."""
    return _mean_over_samples(series, max, 1.0)


def busiest_batch(running: Series) -> float:
    """Mean over samples of the largest running batch."""
    rows = _rows(running)
    return sum(max(row) for row in rows) / len(rows)


def busiest_share(running: Series) -> list[float]:
    """Per rank, the share of samples in which it holds the largest batch; a k-way tie gives each 1/k."""
    rows = _rows(running)
    shares = [0.0] * len(rows[0])
    for row in rows:
        peak = max(row)
        top = [j for j, x in enumerate(row) if x == peak]
        for j in top:
            shares[j] += 1 / len(top) / len(rows)
    return shares


def rank_batch_ratio(running: Series) -> list[float]:
    rows = _rows(running)
    per_rank = [sum(column) / len(rows) for column in zip(*rows)]
    overall = sum(per_rank) / len(per_rank)
    return [x / overall for x in per_rank] if overall > 0 else [1.0] * len(per_rank)


def balance_stats(outstanding: Series, running: Series, kv_tokens: Series) -> BalanceStats:
    """All statistics of one run; the three series are [samples][ranks]."""
    assert len(running) > 0 and len(running[0]) > 0, "need at least one sample of every rank"
    shapes = {(len(s), tuple(len(row) for row in s)) for s in (outstanding, running, kv_tokens)}
    assert len(shapes) == 1, "series must have the same shape"
    return BalanceStats(
        outstanding_cv=mean_cv(outstanding),
        running_cv=mean_cv(running),
        busiest_batch=busiest_batch(running),
        busiest_over_mean_kv=busiest_over_mean(kv_tokens),
        rank_batch_ratio=tuple(rank_batch_ratio(running)),
        busiest_share=tuple(busiest_share(running)),
        num_samples=len(running),
    )
