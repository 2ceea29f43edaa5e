"""What the live cluster page shows (`GET /dashboard/data`), sampled beside the routing path.

Every `--dashboard-interval-secs` one task polls every server's `/v1/loads` (core and PD queues) and records one
sample: per DP rank (`url@rank`, as the balance sampler names them) the router's in-flight count and the rank's
running, waiting, outstanding and KV tokens. Samples are kept for `--dashboard-history-secs`. Asked for the data,
it computes the upstream p2c study's balance figures over the samples of the last `--dashboard-window-secs`
(`protocol/balance.py`, the code `sim/balance_sampling.py` uses), and the router's TTFT and request-duration percentiles
over the requests that ended in that window.

The routing path only appends one tuple per request to `RouterMetrics.recent`; the sampling and the figures run on
the router's loop once a second, or when the page asks.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp

from sglang_lite.protocol.balance import balance_stats, outstanding_of
from sglang_lite.protocol.loads import section

from ..config import RouterConfig
from ..load_monitor import LoadPollError, fetch_payload
from ..metrics import RouterMetrics
from ..workers import Server, Worker

logger = logging.getLogger("sglang_lite.router")
INCLUDE = "core,disagg"
PD_QUEUES = (
    "prefill_prealloc_queue_reqs",
    "prefill_inflight_queue_reqs",
    "decode_prealloc_queue_reqs",
    "decode_transfer_queue_reqs",
    "decode_retracted_queue_reqs",
)
PERCENTILES = (50, 90, 99)


@dataclass
class ServerPoll:
    """One server's last `/v1/loads`: its ranks' entries, or why there are none (or only some)."""

    entries: dict[int, dict[str, Any]] = field(default_factory=dict)
    error: str | None = None


class ClusterWatch:
    def __init__(
        self,
        config: RouterConfig,
        servers: Callable[[], list[Server]],
        metrics: RouterMetrics,
        policies: Callable[[], dict[str, str]],
    ) -> None:
        self.interval = config.dashboard_interval_secs
        self.window = config.dashboard_window_secs
        self.history = config.dashboard_history_secs
        self.servers = servers
        self.metrics = metrics
        self.policies = policies
        self.samples: collections.deque[dict] = collections.deque(
            maxlen=int(self.history / self.interval) + 1
        )
        self.polls: dict[str, ServerPoll] = {}  # server URL -> its last poll
        self.seq = 0
        self.started = time.monotonic()

    # ---- sampling ----------------------------------------------------------------------------------------------
    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            began = time.monotonic()
            await self.sample_once(session)
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - began)))

    async def sample_once(self, session: aiohttp.ClientSession) -> None:
        servers = self.servers()
        polls = await asyncio.gather(*(self._poll(session, s) for s in servers))
        self.polls = {s.url: p for s, p in zip(servers, polls)}
        ranks = {
            f"{s.url}@{rank}": self._rank_series(s, rank, entry)
            for s in servers
            for rank, entry in sorted(self.polls[s.url].entries.items())
        }
        self.seq += 1
        finished = sum(self.metrics.requests.values())
        self.samples.append(
            {"seq": self.seq, "t": round(self._now(), 3), "requests": finished, "ranks": ranks}
        )

    async def _poll(self, session: aiohttp.ClientSession, server: Server) -> ServerPoll:
        """The server's ranks; when the whole-server poll fails with an HTTP error (a dead rank makes it 503),
        each rank it had is asked alone, so the live ones stay on the page."""
        timeout = min(5.0, max(1.0, self.interval))
        try:
            return ServerPoll(
                _entries(await fetch_payload(session, server, timeout, None, INCLUDE))
            )
        except LoadPollError as exc:
            known = set(self.polls.get(server.url, ServerPoll()).entries) | _worker_ranks(server)
            if not exc.http or len(known) < 2:
                return ServerPoll(error=str(exc))
            asks = [fetch_payload(session, server, timeout, r, INCLUDE) for r in sorted(known)]
            answers = await asyncio.gather(*asks, return_exceptions=True)
            entries = {
                rank: entry
                for answer in answers
                if not isinstance(answer, BaseException)
                for rank, entry in _entries(answer).items()
            }
            return ServerPoll(entries, str(exc))

    def _rank_series(self, server: Server, rank: int, entry: dict[str, Any]) -> dict[str, Any]:
        worker = _worker_of(server, rank)
        return {
            "in_flight": None if worker is None else worker.in_flight,
            "running": int(entry.get("num_running_reqs", 0)),
            "waiting": int(entry.get("num_waiting_reqs", 0)),
            "outstanding": outstanding_of(entry),
            "kv_tokens": int(entry.get("num_total_tokens", 0)),
        }

    def _now(self) -> float:
        return time.monotonic() - self.started

    # ---- the data ----------------------------------------------------------------------------------------------
    def snapshot(self, since: int = 0) -> dict[str, Any]:
        """Everything the page shows; `samples` holds only those after sample number `since`."""
        window = self.window_samples()
        servers = self.servers()
        return {
            "now": round(self._now(), 3),
            "interval_secs": self.interval,
            "window_secs": self.window,
            "history_secs": self.history,
            "policies": self.policies(),
            "request_rate": _rate(window),
            "latency": self.latency(),
            "groups": [self.group(role, keys, window) for role, keys in self._groups(servers)],
            "servers": [self._server_view(s) for s in servers],
            "samples": [s for s in self.samples if s["seq"] > since],
        }

    def window_samples(self) -> list[dict]:
        """The samples of the last `window` seconds, counted back from the newest."""
        if not self.samples:
            return []
        newest = self.samples[-1]["t"]
        return [s for s in self.samples if s["t"] > newest - self.window]

    def group(self, role: str, keys: list[str], window: list[dict]) -> dict[str, Any]:
        """The balance figures of one role's ranks over the window's samples that hold every one of them (as the
        balance sampler drops a poll that missed a rank)."""
        rows = [s["ranks"] for s in window if all(k in s["ranks"] for k in keys)]
        balance = None
        if keys and rows:
            series = {
                n: [[r[k][n] for k in keys] for r in rows] for n in ("outstanding", "running")
            }
            kv = [[r[k]["kv_tokens"] for k in keys] for r in rows]
            stats = balance_stats(series["outstanding"], series["running"], kv)
            balance = {k: v for k, v in dataclasses.asdict(stats).items() if k != "poll_failures"}
        return {"role": role, "ranks": keys, "balance": balance}

    def latency(self) -> dict[str, dict[str, float | int | None]]:
        """Percentiles (seconds) of the requests that ended in the window (at most the newest RECENT_REQUESTS)."""
        cutoff = time.monotonic() - self.window
        recent = [r for r in self.metrics.recent if r[0] >= cutoff]
        durations = sorted(seconds for _, seconds, _ in recent)
        ttfts = sorted(ttft for _, _, ttft in recent if ttft is not None)
        return {"ttft": _percentiles(ttfts), "duration": _percentiles(durations)}

    def _groups(self, servers: list[Server]) -> list[tuple[str, list[str]]]:
        """Per role, the ranks of its servers in the newest sample."""
        newest = self.samples[-1]["ranks"] if self.samples else {}
        groups: dict[str, list[str]] = {}
        for server in servers:
            keys = [k for k in newest if k.rsplit("@", 1)[0] == server.url]
            groups.setdefault(server.role, []).extend(keys)
        return list(groups.items())

    def _server_view(self, server: Server) -> dict[str, Any]:
        poll = self.polls.get(server.url, ServerPoll(error="not polled yet"))
        now = time.monotonic()
        ranks = sorted(set(poll.entries) | _worker_ranks(server))
        return {
            "url": server.url,
            "role": server.role,
            "healthy": server.healthy,
            "breaker": server.breaker.state,
            "in_flight": sum(w.in_flight for w in server.workers),
            "loads_error": poll.error,
            "ranks": [self._rank_view(server, r, poll.entries.get(r), now) for r in ranks],
        }

    def _rank_view(
        self, server: Server, rank: int, entry: dict[str, Any] | None, now: float
    ) -> dict[str, Any]:
        worker = _worker_of(server, rank)
        view = {
            "key": f"{server.url}@{rank}",
            "dp_rank": rank,
            "rank_up": None if worker is None else worker.rank_up(now),
            "in_flight": None if worker is None else worker.in_flight,
            "reported": entry is not None,
        }
        if entry is None:
            return view
        pd = section(entry, "disaggregation")
        return view | {
            **self._rank_series(server, rank, entry),
            "kv_used": entry.get("num_used_tokens"),
            "max_kv_tokens": entry.get("max_total_num_tokens"),
            "token_usage": entry.get("token_usage"),
            "mode": pd.get("mode", "null"),
            "pd": {q: pd.get(q, 0) for q in PD_QUEUES},
        }


def _entries(payload: object) -> dict[int, dict[str, Any]]:
    loads = payload.get("loads") if isinstance(payload, dict) else None
    if not isinstance(loads, list):
        return {}
    return {
        e["dp_rank"]: e
        for e in loads
        if isinstance(e, dict) and isinstance(e.get("dp_rank"), int) and e["dp_rank"] >= 0
    }


def _worker_of(server: Server, rank: int) -> Worker | None:
    return next((w for w in server.workers if w.dp_rank == rank), None)


def _worker_ranks(server: Server) -> set[int]:
    return {w.dp_rank for w in server.workers if w.dp_rank is not None}


def _rate(window: list[dict]) -> float | None:
    """Requests ended per second over the window."""
    if len(window) < 2 or window[-1]["t"] <= window[0]["t"]:
        return None
    return (window[-1]["requests"] - window[0]["requests"]) / (window[-1]["t"] - window[0]["t"])


def _percentiles(values: list[float]) -> dict[str, float | int | None]:
    """p50/p90/p99 of sorted values, interpolated linearly between the closest ranks (numpy's default)."""
    out: dict[str, float | int | None] = {"count": len(values)}
    for p in PERCENTILES:
        out[f"p{p}"] = _percentile(values, p) if values else None
    return out


def _percentile(values: list[float], p: float) -> float:
    position = (len(values) - 1) * p / 100
    low = int(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)
