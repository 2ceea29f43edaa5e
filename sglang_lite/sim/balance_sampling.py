"""DP-rank balance of real servers: sample `/v1/loads` of every server at a fixed interval while a benchmark runs,
then summarise how even the ranks were with the study's figures (`protocol/balance.py`: the definitions, shared
with the simulator and the router's live page).

A poll that fails leaves a gap; it is logged (at most every LOG_EVERY_SECS per server) and counted per server in
`LoadSeries.poll_failures`, which `stats()` carries into `BalanceStats.poll_failures` and `format_table` prints.
"""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from sglang_lite.protocol.balance import BalanceStats, balance_stats, outstanding_of

logger = logging.getLogger(__name__)
LOG_EVERY_SECS = 30.0


# ---- sampling real servers -------------------------------------------------------------------------------------
@dataclass
class LoadSeries:
    """Raw samples: one row per (poll, rank); `ranks` names each column as 'server@rank'."""

    ranks: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    outstanding: list[list[int]] = field(default_factory=list)
    running: list[list[int]] = field(default_factory=list)
    kv_tokens: list[list[int]] = field(default_factory=list)
    kv_used: list[list[int]] = field(default_factory=list)
    gen_throughput: list[list[float]] = field(default_factory=list)
    poll_failures: Counter = field(default_factory=Counter)  # server URL -> failed polls

    def add(self, t: float, per_rank: dict[str, dict]) -> None:
        """One poll; a poll that misses a known rank is dropped so that every row has every rank."""
        if not self.ranks:
            self.ranks = sorted(per_rank)
        if any(r not in per_rank for r in self.ranks):
            return
        entries = [per_rank[r] for r in self.ranks]
        self.times.append(t)
        self.outstanding.append([outstanding_of(e) for e in entries])
        self.running.append([int(e.get("num_running_reqs", 0)) for e in entries])
        self.kv_tokens.append([int(e.get("num_total_tokens", 0)) for e in entries])
        self.kv_used.append([int(e.get("num_used_tokens", 0)) for e in entries])
        self.gen_throughput.append([float(e.get("gen_throughput", 0.0)) for e in entries])

    def stats(self, min_total_outstanding: int = 0) -> BalanceStats:
        """Statistics over the samples holding at least `min_total_outstanding` requests in all: a closed-loop
        benchmark passes about half its concurrency to leave out the ramp-up and the drain at the end, where a
        handful of requests on few ranks would dominate every CV."""
        keep = [i for i, row in enumerate(self.outstanding) if sum(row) >= min_total_outstanding]
        assert keep, f"no sample holds {min_total_outstanding} requests"
        pick = lambda series: [series[i] for i in keep]  # noqa: E731
        stats = balance_stats(pick(self.outstanding), pick(self.running), pick(self.kv_tokens))
        return dataclasses.replace(stats, poll_failures=sum(self.poll_failures.values()))

    def write_csv(self, path: str | Path) -> None:
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(
                ["time", "rank", "outstanding", "running", "kv_tokens", "kv_used", "gen_throughput"]
            )
            for i, t in enumerate(self.times):
                for j, rank in enumerate(self.ranks):
                    w.writerow(
                        [
                            f"{t:.3f}",
                            rank,
                            self.outstanding[i][j],
                            self.running[i][j],
                            self.kv_tokens[i][j],
                            self.kv_used[i][j],
                            f"{self.gen_throughput[i][j]:.3f}",
                        ]
                    )

    def plot(self, path: str | Path, title: str = "") -> None:
        plot_series(path, self.times, self.ranks, self.outstanding, self.running, title)


def plot_series(
    path: str | Path,
    times: Sequence[float],
    ranks: Sequence[str],
    outstanding,
    running,
    title: str = "",
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for ax, data, label in (
        (axes[0], outstanding, "outstanding requests"),
        (axes[1], running, "running batch"),
    ):
        data = np.asarray(data)
        for j, rank in enumerate(ranks):
            ax.plot(times, data[:, j], lw=0.8, label=rank)
        ax.set_ylabel(label)
    axes[1].set_xlabel("time (s)")
    axes[0].legend(fontsize=6, ncol=4)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class BalanceSampler:
    """Polls `GET {url}/v1/loads` of every server every `interval` seconds while a benchmark runs.

    Usage: `async with BalanceSampler(urls, 0.5) as sampler: await run_benchmark()`, then `sampler.series`.
    """

    def __init__(
        self, server_urls: Sequence[str], interval: float = 0.5, timeout: float = 2.0
    ) -> None:
        self.server_urls = [u.rstrip("/") for u in server_urls]
        self.interval = interval
        self.timeout = timeout
        self.series = LoadSeries()
        self._task: asyncio.Task | None = None
        self._start = 0.0
        self._logged_at: dict[str, float] = {}

    async def __aenter__(self) -> BalanceSampler:
        import httpx

        self._client = httpx.AsyncClient(timeout=self.timeout)
        self._start = time.monotonic()
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        await self._client.aclose()

    async def _run(self) -> None:
        while True:
            t = time.monotonic() - self._start
            polls = await asyncio.gather(*(self._poll(u) for u in self.server_urls))
            merged = {k: v for poll in polls for k, v in poll.items()}
            if merged:
                self.series.add(t, merged)
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - self._start - t)))

    async def _poll(self, url: str) -> dict[str, dict]:
        import httpx

        try:
            resp = await self._client.get(f"{url}/v1/loads")
            resp.raise_for_status()
            return {
                f"{url}@{e['dp_rank']}": e for e in resp.json().get("loads", []) if "dp_rank" in e
            }
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            # a gap in the series, as in the router's load monitor, but counted
            self._record_failure(url, exc)
            return {}

    def _record_failure(self, url: str, exc: Exception) -> None:
        self.series.poll_failures[url] += 1
        now = time.monotonic()
        if now - self._logged_at.get(url, -LOG_EVERY_SECS) >= LOG_EVERY_SECS:
            self._logged_at[url] = now
            logger.warning(
                "load poll of %s failed (%d so far): %r", url, self.series.poll_failures[url], exc
            )


def format_table(rows: dict[str, BalanceStats], baseline: str | None = None) -> str:
    """One line per run; with `baseline`, each metric also shows its change against that run in percent."""
    names = ("outstanding_cv", "running_cv", "busiest_batch", "busiest_over_mean_kv")
    lines = [f"{'policy':<18}" + "".join(f"{n:>26}" for n in names) + f"{'poll_failures':>15}"]
    base = rows.get(baseline) if baseline else None
    for label, s in rows.items():
        cells = []
        for n in names:
            v = s.row()[n]
            delta = _pct(v, base.row()[n]) if base is not None and label != baseline else ""
            cells.append(f"{v:>14.3f}{delta:>12}")
        lines.append(f"{label:<18}" + "".join(cells) + f"{s.poll_failures:>15}")
    return "\n".join(lines)


def _pct(v: float, base: float) -> str:
    return f"({(v - base) / base * 100:+.1f}%)" if base else ""
