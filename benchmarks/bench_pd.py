"""TTFT and TPOT with and without PD disaggregation: the same bench_serving sweep against two setups on one host.

(a) one plain server; (b) a prefill server + a decode server (`--decode-dp-size` ranks) behind sglang_lite's router
in PD mode (`--pd-disaggregation --dp-aware`, decode policy power_of_two with least_requests). Both run the tiny
model with dummy weights, one torch thread per rank, and are started one after the other (never together, so
that they do not share the CPUs). Prints the two sweeps side by side with PD / plain ratios, then the decode
server's KV transfer figures (from /v1/loads, summed over its ranks) for the sweep and for a few long prompts
(`--long-input-len`, sent first, one at a time, on fresh pools), where bytes and GB/s are less dominated by the
per-call overhead.

    python benchmarks/bench_pd.py --out /tmp/bench_pd
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bench_serving
import httpx
from bench_balance import TRANSFER_TOTALS, server_cmd, start, stop, wait_healthy

from sglang_lite.assets import TINY_MODEL_DIR


@dataclass
class Setup:
    """The URL a client sends to, the decode server's URL (PD only) and every process started for it."""

    url: str = ""
    decode_url: str = ""
    procs: list[subprocess.Popen] = field(default_factory=list)

    def start(self, cmd: list[str], log: Path) -> None:
        self.procs.append(start(cmd, log))

    def wait(self, url: str, timeout: float) -> None:
        wait_healthy(url, self.procs[-1], timeout)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)


def start_plain(setup: Setup, args: argparse.Namespace, out: Path) -> None:
    setup.url = f"http://127.0.0.1:{args.base_port + 1}"
    setup.start(server_cmd(args.base_port + 1, args), out / "plain.log")
    setup.wait(setup.url, args.startup_timeout)


def start_pd(setup: Setup, args: argparse.Namespace, out: Path) -> None:
    prefill_port, decode_port, bootstrap_port = (
        args.base_port + 2,
        args.base_port + 3,
        args.base_port + 4,
    )
    prefill, setup.decode_url = (
        f"http://127.0.0.1:{prefill_port}",
        f"http://127.0.0.1:{decode_port}",
    )
    setup.start(
        server_cmd(
            prefill_port,
            args,
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(bootstrap_port),
        ),
        out / "prefill.log",
    )
    setup.start(
        server_cmd(
            decode_port,
            args,
            "--disaggregation-mode",
            "decode",
            "--dp-size",
            str(args.decode_dp_size),
        ),
        out / "decode.log",
    )
    setup.wait(setup.decode_url, args.startup_timeout)
    setup.wait(prefill, args.startup_timeout)
    setup.url = f"http://127.0.0.1:{args.base_port}"
    setup.start(
        [
            sys.executable,
            "-m",
            "sglang_lite.router",
            "--host",
            "127.0.0.1",
            "--port",
            str(args.base_port),
            "--pd-disaggregation",
            "--prefill",
            prefill,
            str(bootstrap_port),
            "--decode",
            setup.decode_url,
            "--dp-aware",
            "--decode-policy",
            "power_of_two",
            "--p2c-load-metric",
            "least_requests",
            "--worker-startup-check-interval",
            "0.5",
        ],
        out / "router.log",
    )
    setup.wait(setup.url, 60)


# ---- load generation ----------------------------------------------------------------------------------------------
def serving_args(
    url: str, input_len: int, output_len: int, num_prompts: int, seed: int
) -> argparse.Namespace:
    return bench_serving.parse_args(
        [
            "--base-url",
            url,
            "--backend",
            "sglang",
            "--dataset",
            "fixed",
            "--input-len",
            str(input_len),
            "--output-len",
            str(output_len),
            "--num-prompts",
            str(num_prompts),
            "--tokenizer",
            str(TINY_MODEL_DIR),
            "--seed",
            str(seed),
            "--no-progress",
        ]
    )


async def sweep(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """A short warm-up (first forwards, connections), then one bench_serving level per concurrency."""
    warm = serving_args(url, args.input_len, args.output_len, 4, seed=1)
    await bench_serving.run_level(warm, bench_serving.make_prompts(warm), 2)
    serving = serving_args(url, args.input_len, args.output_len, args.num_prompts, seed=0)
    prompts = bench_serving.make_prompts(serving)
    levels = [
        await bench_serving.run_level(serving, prompts, int(c)) for c in args.concurrency.split(",")
    ]
    for level in levels:
        assert level["failed"] == 0, f"{url}: {level['failed']} requests failed: {level['errors']}"
        assert level["total_output_tokens"] == level["completed"] * args.output_len, (
            f"{url}: short outputs"
        )
    return levels


def transfer_totals(decode_url: str) -> dict[str, float]:
    loads = httpx.get(f"{decode_url}/v1/loads", params={"include": "disagg"}, timeout=5).json()[
        "loads"
    ]
    return {k: sum(load["disaggregation"][k] for load in loads) for k in TRANSFER_TOTALS}


def transfer_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per transfer means over the interval: bytes, latency (as the prefill side timed its writes) and GB/s."""
    n, nbytes, seconds = (after.get(k, 0) - before.get(k, 0) for k in TRANSFER_TOTALS)
    if n <= 0:
        return {"transfers": 0, "bytes_per_request": 0.0, "latency_ms": 0.0, "speed_gb_s": 0.0}
    return {
        "transfers": n,
        "bytes_per_request": nbytes / n,
        "latency_ms": seconds / n * 1e3,
        "speed_gb_s": nbytes / seconds / 1e9 if seconds > 0 else 0.0,
    }


async def long_prompts(setup: Setup, args: argparse.Namespace) -> list[dict[str, float]]:
    """Deltas of the decode server's transfer totals for each of `--long-prompts` requests of `--long-input-len`
    tokens, sent one at a time."""
    long = serving_args(setup.url, args.long_input_len, 4, args.long_prompts, seed=2)
    figures = []
    for prompt in bench_serving.make_prompts(long):
        before = await asyncio.to_thread(transfer_totals, setup.decode_url)
        level = await bench_serving.run_level(long, [prompt], 1)
        assert level["failed"] == 0, f"a long prompt failed: {level['errors']}"
        after = await asyncio.to_thread(transfer_totals, setup.decode_url)
        figures.append({k: after[k] - before[k] for k in TRANSFER_TOTALS})
    return figures


def pooled(deltas: list[dict[str, float]]) -> dict[str, float]:
    """The transfer figures of several requests' deltas of the totals taken together."""
    return transfer_figures({}, {k: sum(d[k] for d in deltas) for k in TRANSFER_TOTALS})


def per_request(deltas: list[dict[str, float]]) -> str:
    return ", ".join(f"{transfer_figures({}, d)['latency_ms']:.1f}" for d in deltas)


async def run_pd(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The long prompts go first, on fresh pools: the first one's KV slots are consecutive on both sides, later
    ones reuse freed slots (see docs/pd.md on why that matters)."""
    setup = Setup()
    try:
        await asyncio.to_thread(start_pd, setup, args, out)
        long = await long_prompts(setup, args)
        before = await asyncio.to_thread(transfer_totals, setup.decode_url)
        levels = await sweep(setup.url, args)
        sweep_transfers = transfer_figures(
            before, await asyncio.to_thread(transfer_totals, setup.decode_url)
        )
        return {
            "levels": levels,
            "sweep_transfers": sweep_transfers,
            "long": long,
            "loadavg": os.getloadavg(),
        }
    finally:
        setup.stop()


async def run_plain(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    setup = Setup()
    try:
        await asyncio.to_thread(start_plain, setup, args, out)
        return {"levels": await sweep(setup.url, args), "loadavg": os.getloadavg()}
    finally:
        setup.stop()


# ---- report -------------------------------------------------------------------------------------------------------
def _pair(plain: float, pd: float, digits: int = 1) -> str:
    ratio = f"{pd / plain:.2f}x" if plain else "-"
    return f"{plain:.{digits}f} / {pd:.{digits}f} ({ratio})"


def side_by_side(plain: list[dict[str, Any]], pd: list[dict[str, Any]]) -> str:
    cols = ("TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms", "out tok/s")
    head = f"{'conc':>4} | {'ok':>7} | " + " | ".join(
        f"{c + ' plain / PD (PD/plain)':>34}" for c in cols
    )
    rows = [head, "-" * len(head)]
    for a, b in zip(plain, pd):
        cells = (
            _pair(a["ttft_ms"]["p50"], b["ttft_ms"]["p50"]),
            _pair(a["ttft_ms"]["p90"], b["ttft_ms"]["p90"]),
            _pair(a["tpot_ms"]["p50"], b["tpot_ms"]["p50"], 2),
            _pair(a["output_throughput"], b["output_throughput"]),
        )
        rows.append(
            f"{a['concurrency']:>4} | {a['completed']:>3}/{b['completed']:<3} | "
            + " | ".join(f"{c:>34}" for c in cells)
        )
    return "\n".join(rows)


def transfer_table(rows: dict[str, dict[str, float]]) -> str:
    lines = [f"{'prompts':<30}{'transfers':>10}{'bytes/request':>15}{'latency ms':>12}{'GB/s':>8}"]
    for label, t in rows.items():
        lines.append(
            f"{label:<30}{t['transfers']:>10.0f}{t['bytes_per_request']:>15,.0f}{t['latency_ms']:>12.2f}"
            f"{t['speed_gb_s']:>8.3f}"
        )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started, load_before = time.perf_counter(), os.getloadavg()
    plain = await run_plain(args, out)
    pd = await run_pd(args, out)
    results = {"config": vars(args), "plain": plain, "pd": pd, "loadavg_before": load_before}
    (out / "bench_pd.json").write_text(json.dumps(results, indent=2))
    print(
        f"\n{os.cpu_count()} CPUs; load average (1/5/15 min) before {_load(load_before)}, after the plain run "
        f"{_load(plain['loadavg'])}, after the PD run {_load(pd['loadavg'])}; {time.perf_counter() - started:.0f} s"
    )
    print(
        f"input {args.input_len} tokens, output {args.output_len}, {args.num_prompts} requests per level; "
        f"PD: 1 prefill + 1 decode server ({args.decode_dp_size} DP ranks) behind the router\n"
    )
    print(side_by_side(plain["levels"], pd["levels"]))
    print(
        "\ndecode server's KV transfers (means per transfer; latency and speed as the prefill side timed its "
        "writes):"
    )
    print(
        transfer_table(
            {
                f"sweep, {args.input_len} tokens": pd["sweep_transfers"],
                f"{args.long_input_len} tokens, odd (1st, 3rd..)": pooled(pd["long"][0::2]),
                f"{args.long_input_len} tokens, even": pooled(pd["long"][1::2]),
            }
        )
    )
    print(
        f"latency ms of each {args.long_input_len}-token transfer in order: {per_request(pd['long'])}"
    )


def _load(loadavg: tuple[float, ...]) -> str:
    return "/".join(f"{x:.2f}" for x in loadavg)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--concurrency", default="1,4", help="comma-separated levels of the sweep")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per level")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument(
        "--long-input-len", type=int, default=700, help="prompt length of the transfer measurement"
    )
    p.add_argument("--long-prompts", type=int, default=8)
    p.add_argument("--decode-dp-size", type=int, default=1)
    p.add_argument("--kv-tokens", type=int, default=16384)
    p.add_argument("--page-size", type=int, default=None, help="the servers' --page-size")
    p.add_argument(
        "--base-port", type=int, default=32000, help="router port; servers use the next ports"
    )
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--out", default="bench_pd_out")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
