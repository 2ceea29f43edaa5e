"""Runs every (policy, concurrency) pair and prints one table, each metric with its change against a baseline.

Runs are independent simulations, spread over worker processes; each is deterministic for its seed, so the
table is the same whatever the number of processes.
"""

from __future__ import annotations

import dataclasses
from multiprocessing import get_context
from pathlib import Path
from typing import Sequence

from sglang_lite.sim.cluster import SimResult, simulate
from sglang_lite.sim.sim_config import SimConfig

METRICS = (  # (key in SimResult.row(), column title, format)
    ("output_tok_s_per_gpu", "tok/s/GPU", "{:.1f}"),
    ("tpot_p50_ms", "TPOT p50 ms", "{:.2f}"),
    ("tpot_p90_ms", "TPOT p90 ms", "{:.2f}"),
    ("outstanding_cv", "outst. CV", "{:.3f}"),
    ("running_cv", "running CV", "{:.3f}"),
    ("busiest_batch", "busiest batch", "{:.2f}"),
    ("busiest_over_mean_kv", "max/mean KV", "{:.3f}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.2f}"),
    ("ttft_p90_s", "TTFT p90 s", "{:.2f}"),
    ("transfer_share", "waiting on KV", "{:.2f}"),
    ("max_busiest_share", "busiest-rank share", "{:.3f}"),
)


def _run(config: SimConfig) -> SimResult:
    result = simulate(config)
    # Drop the per-request bookkeeping before it crosses the process boundary; the series stay for the plots.
    return dataclasses.replace(result, finish_counts={})


def run_grid(
    base: SimConfig, policies: Sequence[str], concurrencies: Sequence[int], processes: int = 2
) -> dict[tuple[str, int], SimResult]:
    configs = [
        dataclasses.replace(base, policy=p, concurrency=c) for c in concurrencies for p in policies
    ]
    if processes <= 1:
        results = [_run(c) for c in configs]
    else:
        with get_context("spawn").Pool(
            processes
        ) as pool:  # spawn: no forked copy of a torch-importing parent
            results = pool.map(_run, configs, chunksize=1)
    return {(c.policy, c.concurrency): r for c, r in zip(configs, results)}


def delta(value: float, base: float) -> str:
    return f"{(value - base) / base * 100:+.1f}%" if base else "n/a"


def format_table(results: dict[tuple[str, int], SimResult], baseline: str = "round_robin") -> str:
    """Markdown: one row per (concurrency, policy); a cell is 'value (change vs baseline)'."""
    head = "| conc | policy | " + " | ".join(title for _, title, _ in METRICS) + " |"
    lines = [head, "|" + "---|" * (len(METRICS) + 2)]
    for (policy, conc), res in sorted(results.items(), key=lambda kv: kv[0][1]):
        base = results.get((baseline, conc))
        cells = []
        for key, _, fmt in METRICS:
            value = res.row()[key]
            text = fmt.format(value)
            if base is not None and policy != baseline:
                text += f" ({delta(value, base.row()[key])})"
            cells.append(text)
        lines.append(f"| {conc} | {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_grid(results: dict[tuple[str, int], SimResult], path: str | Path) -> None:
    """One panel per metric against concurrency, a line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(p for p, _ in results))
    concs = sorted({c for _, c in results})
    fig, axes = plt.subplots(3, 4, figsize=(16, 10))
    for ax, (key, title, _) in zip(axes.flat, METRICS):
        for p in policies:
            ax.plot(concs, [results[(p, c)].row()[key] for c in concs], marker="o", label=p)
        ax.set_title(title)
        ax.set_xlabel("concurrency")
    for ax in axes.flat[len(METRICS) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ranks(result: SimResult, path: str | Path) -> None:
    from sglang_lite.sim.balance_sampling import plot_series

    ranks = [f"rank{i}" for i in range(result.running.shape[1])]
    title = f"{result.config.policy}, concurrency {result.config.concurrency}"
    plot_series(path, result.sample_times, ranks, result.outstanding, result.running, title)
