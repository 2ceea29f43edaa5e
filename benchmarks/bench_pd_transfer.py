"""The PD transfer per decode rank: 1 prefill server + 1 decode server with `--decode-dp-size` ranks behind the
router, `--num-prompts` requests of `--input-len` tokens and `--output-len` output tokens (after a warm-up), and
per decode rank the mean time a request's transfer took (`kv_transfer_seconds_total / kv_transfers_total` over the
measured requests, as the prefill side timed its write) beside what the decode side saw (from the reservation to
noticing the data, and from the write's end to noticing it).

    python benchmarks/bench_pd_transfer.py --out /tmp/bench_pd_transfer
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import bench_serving
import httpx
from bench_pd import Setup, serving_args, start_pd

FIGURES = (
    "kv_transfers_total",
    "kv_transfer_bytes_total",
    "kv_transfer_seconds_total",
)


def rank_totals(decode_url: str) -> dict[int, dict[str, float]]:
    loads = httpx.get(f"{decode_url}/v1/loads", params={"include": "all"}, timeout=5).json()[
        "loads"
    ]
    return {
        load["dp_rank"]: {k: float(load["disaggregation"][k]) for k in FIGURES} for load in loads
    }


def per_rank(before: dict, after: dict) -> dict[int, dict[str, float]]:
    out = {}
    for rank, totals in after.items():
        delta = {k: totals[k] - before.get(rank, {}).get(k, 0.0) for k in FIGURES}
        n = delta["kv_transfers_total"]
        out[rank] = {
            "transfers": n,
            "bytes_per_request": delta["kv_transfer_bytes_total"] / n if n else 0.0,
            "mean_ms": delta["kv_transfer_seconds_total"] / n * 1e3 if n else 0.0,
        }
    return out


async def measure(args: argparse.Namespace, setup: Setup) -> dict[str, Any]:
    warm = serving_args(setup.url, args.input_len, args.output_len, args.warmup, seed=1)
    await bench_serving.run_level(warm, bench_serving.make_prompts(warm), args.concurrency)
    before = await asyncio.to_thread(rank_totals, setup.decode_url)
    serving = serving_args(setup.url, args.input_len, args.output_len, args.num_prompts, seed=0)
    level = await bench_serving.run_level(
        serving, bench_serving.make_prompts(serving), args.concurrency
    )
    assert level["failed"] == 0, f"{level['failed']} requests failed: {level['errors']}"
    after = await asyncio.to_thread(rank_totals, setup.decode_url)
    return {"level": level, "ranks": per_rank(before, after), "loadavg": os.getloadavg()}


async def main_async(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    started = time.perf_counter()
    runs = []
    setup = Setup()
    try:
        await asyncio.to_thread(start_pd, setup, args, out)
        for _ in range(args.repeats):
            runs.append(await measure(args, setup))
    finally:
        setup.stop()
    (out / "bench_pd_transfer.json").write_text(json.dumps({"config": vars(args), "runs": runs}))
    print(
        f"{os.cpu_count()} CPUs; load average before {load_before}, after {os.getloadavg()}; "
        f"{time.perf_counter() - started:.0f} s; {args.num_prompts} requests of {args.input_len} tokens, "
        f"output {args.output_len}, concurrency {args.concurrency}, {args.decode_dp_size} decode DP ranks"
    )
    for i, run in enumerate(runs):
        for rank, r in sorted(run["ranks"].items()):
            print(
                f"run {i} rank {rank}: {r['transfers']:.0f} transfers, {r['bytes_per_request']:,.0f} "
                f"bytes/request, mean {r['mean_ms']:.2f} ms"
            )
        level = run["level"]
        print(
            f"run {i}: TTFT p50 {level['ttft_ms']['p50']:.1f} ms, TPOT p50 {level['tpot_ms']['p50']:.2f} ms, "
            f"load average {run['loadavg']}"
        )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-dp-size", type=int, default=2)
    p.add_argument("--kv-tokens", type=int, default=16384)
    p.add_argument("--page-size", type=int, default=None, help="the servers' --page-size")
    p.add_argument("--base-port", type=int, default=33000)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--out", default="bench_pd_transfer_out")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
