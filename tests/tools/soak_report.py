"""What the soak (``benchmarks/bench_soak.py``) found: failures by the rank their error names, hostile answers that
were wrong, prefix-cache hits of the sessions, RSS growth after warm-up, loads at the end; and the RSS plot."""

from __future__ import annotations

import re
from typing import Any


def summarize(report: dict[str, Any], warmup_s: float) -> dict[str, Any]:
    results = report["results"]
    faulted = {e["rank"] for e in report["faults"] if e["what"] in ("killed", "hung")}
    failed = [r for r in results if not r["ok"]]
    unexplained = [r for r in failed if r["rank"] not in faulted]
    # a hostile request the server sent to a rank as it died fails as the valid ones there do
    on_faulted = [o for o in report["hostile"] if not o["ok"] and _names_rank(o["why"], faulted)]
    hostile_bad = [o for o in report["hostile"] if not o["ok"] and o not in on_faulted]
    loads = [
        (load["num_running_reqs"], load["num_waiting_reqs"], load["num_used_tokens"])
        for load in report["loads_after"]
    ]
    in_flight = _router_in_flight(report["router_workers_after"])
    return {
        "minutes": report["seconds"] / 60,
        "valid_requests": len(results),
        "valid_failed": len(failed),
        "valid_failed_by_rank": {
            str(k): sum(r["rank"] == k for r in failed) for k in sorted(faulted)
        },
        "valid_failed_unexplained": unexplained[:20],
        "valid_by_kind": _by_kind(results),
        "session_prefix_hits": _prefix_hits(results),
        "hostile_sent": len(report["hostile"]),
        "hostile_wrong": hostile_bad[:20],
        "hostile_on_faulted_rank": len(on_faulted),
        "hostile_slowest_s": max((o["seconds"] for o in report["hostile"]), default=0.0),
        "faults": report["faults"],
        "rss_growth_mb": rss_growth(report["rss"], warmup_s),
        "load1_mean": _mean([s["load1"] for s in report["rss"]]),
        "load1_max": max((s["load1"] for s in report["rss"]), default=0.0),
        "loads_after": loads,
        "router_in_flight_after": in_flight,
    }


def _prefix_hits(results: list[dict]) -> dict[str, Any]:
    """Sessions' prompt tokens the prefix cache served, over all turns and over the turns after the first."""
    turns = [r for r in results if r["kind"] == "session" and r["ok"]]
    later = [r for r in turns if r["prompt_tokens"] > 216]  # 200 + 16: a first turn's prompt
    return {
        "turns": len(turns),
        "hit_turns": sum(r["cached_tokens"] > 0 for r in turns),
        "cached_over_prompt": _ratio(
            sum(r["cached_tokens"] for r in turns), sum(r["prompt_tokens"] for r in turns)
        ),
        "later_turns_cached_over_prompt": _ratio(
            sum(r["cached_tokens"] for r in later), sum(r["prompt_tokens"] for r in later)
        ),
    }


def _ratio(part: int, whole: int) -> float:
    return round(part / whole, 3) if whole else 0.0


def _names_rank(why: str, ranks: set[int]) -> bool:
    match = re.search(r"DP rank (\d+) died", why)
    return match is not None and int(match.group(1)) in ranks


def _by_kind(results: list[dict]) -> dict[str, list[int]]:
    kinds: dict[str, list[int]] = {}
    for r in results:
        kinds.setdefault(r["kind"], [0, 0])[0 if r["ok"] else 1] += 1
    return kinds


def _router_in_flight(workers: Any) -> int:
    entries = workers.get("workers", workers) if isinstance(workers, dict) else workers
    return sum(int(w.get("in_flight", 0) or 0) for w in entries if isinstance(w, dict))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def rss_growth(samples: list[dict], warmup_s: float, window_s: float = 120.0) -> list[dict]:
    """Per process that lived past the warm-up: the median RSS of its first ``window_s`` after the warm-up (its
    own, from its start, for a rank started again) and of its last ``window_s``, and the difference."""
    by_pid: dict[int, list[dict]] = {}
    for s in samples:
        by_pid.setdefault(s["pid"], []).append(s)
    growth = []
    for pid, series in sorted(by_pid.items(), key=lambda item: item[1][0]["role"]):
        settled = [s for s in series if s["t"] >= max(warmup_s, series[0]["t"] + warmup_s)]
        if len(settled) < 2 or settled[-1]["t"] - settled[0]["t"] < 2 * window_s:
            continue
        head = [s["rss_mb"] for s in settled if s["t"] <= settled[0]["t"] + window_s]
        tail = [s["rss_mb"] for s in settled if s["t"] >= settled[-1]["t"] - window_s]
        growth.append(
            {
                "role": series[0]["role"],
                "pid": pid,
                "from_min": round(settled[0]["t"] / 60, 1),
                "to_min": round(settled[-1]["t"] / 60, 1),
                "rss_mb": round(_median(head), 1),
                "growth_mb": round(_median(tail) - _median(head), 1),
                "max_mb": round(max(s["rss_mb"] for s in settled), 1),
            }
        )
    return growth


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def plot(samples: list[dict], events: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(10, 5))
    by_pid: dict[int, list[dict]] = {}
    for s in samples:
        by_pid.setdefault(s["pid"], []).append(s)
    for pid, series in by_pid.items():
        label = f"{series[0]['role']} ({pid})"
        axes.plot([s["t"] / 60 for s in series], [s["rss_mb"] for s in series], label=label)
    for event in events:
        if event["what"] in ("killed", "hung"):
            axes.axvline(event["t"] / 60, color="grey", linestyle="--")
            axes.text(
                event["t"] / 60,
                0.02,
                f" rank {event['rank']} {event['what']}",
                transform=axes.get_xaxis_transform(),
                rotation=90,
                fontsize=8,
            )
    axes.set_xlabel("minutes")
    axes.set_ylabel("RSS (MiB)")
    axes.set_title(
        "RSS of every process of the soak (dp 2 server, its ranks and grammar workers, the router)"
    )
    axes.legend(fontsize=7, loc="upper left", ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
