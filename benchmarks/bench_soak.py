"""Soak with faults (not in CI): a ``--dp-size 2`` server (the built-in model, random weights, the Qwen3.5 parsers)
behind the router, N minutes of valid traffic at 32 closed-loop streams (``tests.tools.soak``: native and
OpenAI, streaming and not, structured output, n > 1, multi-turn chats with prefix-cache hits) with the hostile
battery (``tests.tools.hostile_cases``) sent to the server in a loop beside it; one rank killed (SIGKILL) at
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.tools

from tests.tools.hostile import run_case, wait_idle  # noqa: E402
from tests.tools.hostile_cases import hostile_cases  # noqa: E402
from tests.tools.soak import Result, run_traffic  # noqa: E402
from tests.tools.soak_report import plot, summarize  # noqa: E402

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
    # consistent hashing: a session's turns (one routing key) go to one rank, which caches the last turn
    command += [
        "--policy",
        "consistent_hashing",
        "--worker-urls",
        server_url,
        "--log-level",
        "warning",
    ]
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument(
        "--hang-timeout", type=float, default=20.0, help="--rank-hang-timeout-s of the server"
    )
    parser.add_argument(
        "--warmup-minutes", type=float, default=8.0, help="RSS growth is measured after it"
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
