"""Soak with faults (not in CI): a ``--dp-size 2`` server (the built-in model, random weights, the Qwen3.5 parsers)
behind the router, N minutes of valid traffic at 32 closed-loop streams (``sglang_lite.bench.soak``: native and
OpenAI, streaming and not, structured output, n > 1, multi-turn chats with prefix-cache hits) with the hostile
battery (``sglang_lite.bench.hostile_cases``) sent to the server in a loop beside it; one rank killed (SIGKILL) at
35% of the run and the other hung (SIGSTOP, found by ``--rank-hang-timeout-s``) at 65%.

It reports the valid requests that failed (each must name a rank that was killed or hung), the hostile requests
that were not a 4xx or a right 200, the RSS of every process over time (a plot) and its growth after warm-up, the
load average, and the loads once the traffic stops (all must be zero).

    nice -n 5 python benchmarks/bench_soak.py --minutes 20 --plot docs/soak_rss.png --output /tmp/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from sglang_lite.bench.hostile import run_case, wait_idle
from sglang_lite.bench.hostile_cases import hostile_cases
from sglang_lite.bench.soak import Result, run_traffic

SERVER_FLAGS = [
    "--dp-size",
    "2",
    "--cpu-threads-per-rank",
    "1",
    "--context-length",
    "1024",
    "--max-total-tokens",
    "16384",
    "--max-running-requests",
    "32",
    "--load-format",
    "dummy",
    "--tool-call-parser",
    "qwen3_coder",
    "--reasoning-parser",
    "qwen3",
    "--log-level",
    "warning",
]
KILL_AT, HANG_AT = 0.35, 0.65  # of the run


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(command: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def start_server(args: argparse.Namespace, logs: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "sglang_lite.launch_server", "--host", "127.0.0.1"]
    command += ["--port", str(port), *SERVER_FLAGS, "--rank-hang-timeout-s", str(args.hang_timeout)]
    server = spawn(command, logs / "server.log")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, server, 600)
    return server, url


def start_router(server_url: str, logs: Path) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "sglang_lite.router", "--port", "0", "--dp-aware"]
    command += ["--policy", "round_robin", "--worker-urls", server_url, "--log-level", "warning"]
    router = spawn(command, logs / "router.log")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        match = re.search(
            r"listening on http://127\.0\.0\.1:(\d+)", (logs / "router.log").read_text()
        )
        if match:
            return router, f"http://127.0.0.1:{match.group(1)}"
        if router.poll() is not None:
            break
        time.sleep(0.2)
    raise RuntimeError(f"the router did not start:\n{(logs / 'router.log').read_text()[-2000:]}")


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy in {timeout_s:g} s")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


# ---- what runs beside the traffic ----------------------------------------------------------------------------------
def role_of(process: psutil.Process) -> str:
    line = " ".join(process.cmdline())
    world = re.search(r"--world=(\d+)", line)
    if world:
        return f"rank {world.group(1)}"
    for needle, role in (("grammar_process", "grammar worker"), ("router", "router")):
        if needle in line:
            return role
    return "http server" if "launch_server" in line else "other"


async def sample_rss(
    roots: list[int], began: float, samples: list[dict], done: asyncio.Event, every_s: float
) -> None:
    """Every ``every_s``: the RSS of every process under ``roots`` (themselves included) and the load average."""
    while not done.is_set():
        now = time.monotonic() - began
        load = os.getloadavg()[0]
        for root in roots:
            try:
                tree = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for process in tree:
                try:
                    rss = process.memory_info().rss / 2**20
                    samples.append(
                        {
                            "t": now,
                            "pid": process.pid,
                            "role": role_of(process),
                            "rss_mb": rss,
                            "load1": load,
                        }
                    )
                except psutil.NoSuchProcess:
                    pass
        try:
            await asyncio.wait_for(done.wait(), every_s)
        except asyncio.TimeoutError:
            pass


async def hostile_loop(
    server_url: str, began: float, outcomes: list[dict], done: asyncio.Event, pause_s: float
) -> None:
    """The battery against the server, one case at a time, over and over until ``done``."""
    cases = hostile_cases()
    async with httpx.AsyncClient(base_url=server_url, timeout=60) as client:
        i = 0
        while not done.is_set():
            case = cases[i % len(cases)]
            outcome = await run_case(client, case, {})
            record = {
                "t": time.monotonic() - began,
                "name": case.name,
                "status": outcome.status,
                "ok": outcome.ok,
            }
            outcomes.append({**record, "why": outcome.why[:300], "seconds": outcome.seconds})
            i += 1
            await asyncio.sleep(pause_s)


async def faults(server_url: str, seconds: float, began: float, events: list[dict]) -> None:
    """SIGKILL rank 0 at KILL_AT of the run; SIGSTOP rank 1 at HANG_AT (the supervisor kills and restarts it)."""
    for at, rank, sig, what in (
        (KILL_AT, 0, signal.SIGKILL, "killed"),
        (HANG_AT, 1, signal.SIGSTOP, "hung"),
    ):
        await asyncio.sleep(max(0.0, at * seconds - (time.monotonic() - began)))
        async with httpx.AsyncClient(timeout=30) as client:
            pid = (await client.get(f"{server_url}/server_info")).json()["scheduler_pids"][rank]
        os.kill(pid, sig)
        events.append({"t": time.monotonic() - began, "rank": rank, "pid": pid, "what": what})
        back = await wait_rank_back(server_url, pid, rank)
        events.append({"t": time.monotonic() - began, "rank": rank, "pid": back, "what": "back"})


async def wait_rank_back(
    server_url: str, old_pid: int, rank: int, timeout_s: float = 900
) -> int | None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=30) as client:
        while time.monotonic() < deadline:
            await asyncio.sleep(2)
            try:
                healthy = (await client.get(f"{server_url}/health")).status_code == 200
                pids = (await client.get(f"{server_url}/server_info")).json()["scheduler_pids"]
            except httpx.HTTPError:
                continue
            if healthy and pids[rank] != old_pid:
                return pids[rank]
    return None


# ---- the run ------------------------------------------------------------------------------------------------------
async def soak(
    args: argparse.Namespace, server_url: str, router_url: str, roots: list[int]
) -> dict[str, Any]:
    seconds = args.minutes * 60
    began = time.monotonic()
    results: list[Result] = []
    samples: list[dict] = []
    outcomes: list[dict] = []
    events: list[dict] = []
    done = asyncio.Event()
    sidecars = [
        asyncio.create_task(sample_rss(roots, began, samples, done, args.sample_every)),
        asyncio.create_task(hostile_loop(server_url, began, outcomes, done, args.hostile_pause)),
    ]
    fault_task = asyncio.create_task(faults(server_url, seconds, began, events))
    await run_traffic(router_url, args.streams, seconds, began, results)
    await fault_task
    done.set()
    await asyncio.gather(*sidecars)
    async with httpx.AsyncClient(base_url=server_url, timeout=30) as client:
        loads = await wait_idle(client, 120)
    async with httpx.AsyncClient(base_url=router_url, timeout=30) as client:
        workers = (await client.get("/workers")).json()
    return {
        "seconds": time.monotonic() - began,
        "results": [r.to_dict() for r in results],
        "rss": samples,
        "hostile": outcomes,
        "faults": events,
        "loads_after": loads,
        "router_workers_after": workers,
    }


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


def rss_growth(samples: list[dict], warmup_s: float) -> list[dict]:
    """Per process that lived past the warm-up: its RSS at the first sample after it and at its last sample."""
    by_pid: dict[int, list[dict]] = {}
    for s in samples:
        by_pid.setdefault(s["pid"], []).append(s)
    growth = []
    for pid, series in sorted(by_pid.items(), key=lambda item: item[1][0]["role"]):
        settled = [s for s in series if s["t"] >= max(warmup_s, series[0]["t"] + warmup_s / 2)]
        if len(settled) < 2:
            continue
        first, last = settled[0], settled[-1]
        growth.append(
            {
                "role": first["role"],
                "pid": pid,
                "from_min": round(first["t"] / 60, 1),
                "to_min": round(last["t"] / 60, 1),
                "rss_mb": round(first["rss_mb"], 1),
                "growth_mb": round(last["rss_mb"] - first["rss_mb"], 1),
            }
        )
    return growth


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument(
        "--hang-timeout", type=float, default=20.0, help="--rank-hang-timeout-s of the server"
    )
    parser.add_argument(
        "--warmup-minutes", type=float, default=3.0, help="RSS growth is measured after it"
    )
    parser.add_argument(
        "--sample-every", type=float, default=10.0, help="seconds between RSS samples"
    )
    parser.add_argument(
        "--hostile-pause", type=float, default=1.0, help="seconds between hostile requests"
    )
    parser.add_argument("--plot", default="soak_rss.png")
    parser.add_argument("--output", default=None, help="the whole record as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="soak-"))
    server, server_url = start_server(args, logs)
    try:
        router, router_url = start_router(server_url, logs)
        try:
            report = asyncio.run(soak(args, server_url, router_url, [server.pid, router.pid]))
        finally:
            stop(router)
    finally:
        stop(server)
    summary = summarize(report, args.warmup_minutes * 60)
    plot(report["rss"], report["faults"], args.plot)
    if args.output:
        Path(args.output).write_text(json.dumps({"summary": summary, **report}, indent=1))
    print(json.dumps(summary, indent=1))
    print(f"logs in {logs}; RSS plot in {args.plot}")
    clean = not summary["valid_failed_unexplained"] and not summary["hostile_wrong"]
    idle = (
        all(load == (0, 0, 0) for load in summary["loads_after"])
        and not summary["router_in_flight_after"]
    )
    return 0 if clean and idle else 1


if __name__ == "__main__":
    sys.exit(main())
