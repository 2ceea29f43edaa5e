from __future__ import annotations

import csv

import numpy as np
import pytest

from sglang_lite.protocol.balance import balance_stats, mean_cv, outstanding_of
from sglang_lite.sim.balance_sampling import LoadSeries, format_table


def test_statistics_on_hand_made_series():
    outstanding = [[2, 2], [4, 0]]  # per-sample CV 0 and 1
    running = [[1, 3], [2, 2]]
    kv = [[100, 300], [0, 0]]  # the all-zero sample is skipped
    s = balance_stats(np.array(outstanding), np.array(running), np.array(kv))
    assert s.outstanding_cv == pytest.approx(0.5)
    assert s.running_cv == pytest.approx(0.25)  # sample 1: std 1 / mean 2; sample 2: 0
    assert s.busiest_batch == pytest.approx(2.5)
    assert s.busiest_over_mean_kv == pytest.approx(1.5)
    assert s.rank_batch_ratio == pytest.approx((0.75, 1.25))
    assert s.busiest_share == pytest.approx((0.25, 0.75))  # the tie in sample 2 is split
    assert s.num_samples == 2


def test_perfect_balance_and_all_idle():
    even = np.full((5, 4), 7)
    s = balance_stats(even, even, even)
    assert s.outstanding_cv == 0 and s.running_cv == 0 and s.busiest_over_mean_kv == 1
    assert s.busiest_share == pytest.approx((0.25,) * 4)
    assert mean_cv(np.zeros((3, 2))) == 0.0


def test_plain_python_figures_equal_numpy_on_random_series():
    """protocol/balance.py computes in plain Python (the router imports it); numpy's formulas agree."""
    rng = np.random.default_rng(0)
    running = rng.integers(0, 20, (300, 8))
    running[::7] = 0  # idle samples are skipped by the CVs
    outstanding = running + rng.integers(0, 5, (300, 8))
    kv = rng.integers(0, 5000, (300, 8))
    kv[::5] = 0

    def over_mean(series, spread):
        means = series.mean(axis=1)
        keep = means > 0
        return (spread(series[keep], axis=1) / means[keep]).mean()

    s = balance_stats(outstanding, running, kv)
    assert s.outstanding_cv == pytest.approx(over_mean(outstanding, np.std), rel=1e-12)
    assert s.running_cv == pytest.approx(over_mean(running, np.std), rel=1e-12)
    assert s.busiest_batch == pytest.approx(running.max(axis=1).mean(), rel=1e-12)
    assert s.busiest_over_mean_kv == pytest.approx(over_mean(kv, np.max), rel=1e-12)
    per_rank = running.mean(axis=0)
    assert s.rank_batch_ratio == pytest.approx(per_rank / per_rank.mean(), rel=1e-12)
    is_max = running == running.max(axis=1, keepdims=True)
    share = (is_max / is_max.sum(axis=1, keepdims=True)).mean(axis=0)
    assert s.busiest_share == pytest.approx(share, rel=1e-12)


def test_mismatched_series_are_rejected():
    with pytest.raises(AssertionError):
        balance_stats(np.ones((2, 2)), np.ones((2, 3)), np.ones((2, 2)))


def _entry(rank, running, waiting=0, transfer=0, tokens=0):
    """A rank's /v1/loads entry in upstream's shape (the PD queues nested in "disaggregation")."""
    return {
        "dp_rank": rank,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_total_tokens": tokens,
        "num_used_tokens": tokens,
        "gen_throughput": 10.0 * running,
        "disaggregation": {
            "decode_transfer_queue_reqs": transfer,
            "prefill_inflight_queue_reqs": 0,
        },
    }


def test_outstanding_counts_every_request_once():
    # a decode rank's num_waiting_reqs already counts its prealloc and transfer queues (as SGLang's does)
    assert outstanding_of(_entry(0, 3, waiting=6, transfer=4)) == 9
    prefill = {"num_running_reqs": 1, "num_waiting_reqs": 0}
    assert outstanding_of(prefill | {"disaggregation": {"prefill_inflight_queue_reqs": 2}}) == 3
    # a section not asked for is null (or absent, from an older server)
    assert outstanding_of(prefill | {"disaggregation": None}) == 1
    assert outstanding_of({"num_running_reqs": 1}) == 1


def test_series_drops_incomplete_polls_and_writes_csv(tmp_path):
    series = LoadSeries()
    series.add(0.0, {"a@0": _entry(0, 2, tokens=10), "a@1": _entry(1, 0, waiting=2, tokens=30)})
    series.add(0.5, {"a@0": _entry(0, 1)})  # rank 1 missing: dropped
    series.add(1.0, {"a@0": _entry(0, 1, tokens=5), "a@1": _entry(1, 1, tokens=5)})
    assert series.times == [0.0, 1.0]
    s = series.stats()
    assert s.outstanding_cv == pytest.approx(0.0) and s.busiest_batch == pytest.approx(1.5)
    steady = series.stats(
        min_total_outstanding=3
    )  # only the first sample holds 3 requests (2 + 0 + 1 waiting)
    assert steady.num_samples == 1 and steady.busiest_batch == pytest.approx(2.0)
    path = tmp_path / "loads.csv"
    series.write_csv(path)
    rows = list(csv.DictReader(open(path)))
    assert len(rows) == 4 and rows[1]["rank"] == "a@1" and rows[1]["outstanding"] == "2"
    series.plot(tmp_path / "loads.png")
    assert (tmp_path / "loads.png").stat().st_size > 0


def test_table_shows_change_against_baseline():
    a = balance_stats(np.array([[1, 3]]), np.array([[1, 3]]), np.array([[1, 3]]))
    b = balance_stats(np.array([[2, 2]]), np.array([[2, 2]]), np.array([[2, 2]]))
    table = format_table({"round_robin": a, "least_requests": b}, baseline="round_robin")
    assert "(-100.0%)" in table  # CV 0.5 -> 0
    assert "(-33.3%)" in table  # busiest batch 3 -> 2


def test_sampler_counts_and_logs_failed_polls(caplog):
    import asyncio
    import socket

    from sglang_lite.sim.balance_sampling import BalanceSampler

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"

    async def sample() -> BalanceSampler:
        async with BalanceSampler([url], interval=0.02, timeout=0.5) as sampler:
            while (
                sampler.series.poll_failures.get(url, 0) < 3
            ):  # a loaded machine polls less often than 50/s
                await asyncio.sleep(0.02)
        return sampler

    sampler = asyncio.run(asyncio.wait_for(sample(), 10))
    assert sampler.series.poll_failures[url] >= 3 and not sampler.series.times
    assert (
        sum("load poll of" in r.getMessage() for r in caplog.records) == 1
    )  # rate-limited, not one per poll
    stats = balance_stats(np.ones((1, 2)), np.ones((1, 2)), np.ones((1, 2)))
    assert "poll_failures" in format_table({"p": stats})
    series = LoadSeries()
    series.add(0.0, {"a@0": _entry(0, 1)})
    series.poll_failures["http://a"] += 2
    assert series.stats().poll_failures == 2  # carried into the stats a benchmark prints
