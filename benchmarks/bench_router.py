"""Router overhead: sglang_lite's router vs direct vs sglang-router 0.3.2 (when installed), in one run.

    python benchmarks/bench_router.py [--workers 4] [--duration 3] [--concurrency 64] [--policy round_robin]
        [--watch-dashboard] [--compare-with DIR]

Lightweight mock workers (a fixture of this benchmark only) answer at once, or stream `--stream-tokens`
chunks `--token-delay` apart. The same aiohttp client and load then measure each target:
requests/s at `--concurrency` in flight, p50/p99 latency at concurrency 1 (minus direct = added latency),
time to first token when streaming, and router CPU seconds per request (from /proc, the router's process group).
With --watch-dashboard a client reads this router's /dashboard/data once a second while it is measured, as an
open live page does (the page's cost on the routing path). With --compare-with DIR it instead starts this
checkout's router and the one of another checkout DIR (e.g. `git worktree add /tmp/base main`) on the same mock
workers and sends `--sequential` requests to each, one to this, one to that, so that both see the same machine
state: a before/after comparison that holds on a busy machine. sglang-router is started as
`python -m sglang_router.launch_router --host 127.0.0.1 --port P --worker-urls ... --policy round_robin`; it is
skipped when not importable.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")

MOCK_WORKER = r"""
import asyncio, json, sys
from aiohttp import web
port, delay, tokens = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
ANSWER = json.dumps({"text": "ok", "meta_info": {"completion_tokens": 1, "finish_reason": "stop"}}).encode()

async def generate(request):
    body = await request.json()
    if not body.get("stream"):
        return web.Response(body=ANSWER, content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(tokens):
        if i:
            await asyncio.sleep(delay)
        await resp.write(b'data: {"text": "t%d"}\n\n' % i)
    await resp.write(b"data: [DONE]\n\n")
    return resp

async def info(request):
    return web.json_response({"dp_size": 1, "model_path": "mock"})

async def health(request):
    return web.Response(text="OK")

async def loads(request):
    core = {"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0, "num_total_tokens": 0}
    return web.json_response({"timestamp": "", "version": "mock", "loads": [core]})

async def get_load(request):
    return web.json_response([{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}])

app = web.Application()
for p in ("/generate", "/v1/completions", "/v1/chat/completions"):
    app.router.add_post(p, generate)
for p, h in (("/health", health), ("/health_generate", health), ("/server_info", info), ("/get_server_info", info),
             ("/get_model_info", info), ("/v1/loads", loads), ("/get_load", get_load)):
    app.router.add_get(p, h)
web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Process:
    popen: subprocess.Popen
    log: Path

    def cpu_seconds(self) -> float:
        """utime+stime of every live process in this process group (a launcher and its children)."""
        total = 0
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                total += _group_ticks(int(pid), self.popen.pid)
        return total / CLK_TCK

    def stop(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGTERM)
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()
        except ProcessLookupError:
            pass
        self.log.unlink(missing_ok=True)


def _group_ticks(pid: int, pgid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0
    # after the ")" : state ppid pgrp ... utime(12) stime(13)
    return int(fields[11]) + int(fields[12]) if int(fields[2]) == pgid else 0


def spawn(cmd: list[str], cwd: Path = REPO) -> Process:
    log = Path(tempfile.mkstemp(prefix="bench-router-", suffix=".log")[1])
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd
        )
    return Process(popen, log)


async def wait_http(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


# ---- load --------------------------------------------------------------------------------------------------
BODY = {"text": "benchmark prompt", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}


async def one(
    s: aiohttp.ClientSession, url: str, stream: bool = False
) -> tuple[float, float | None]:
    start = time.perf_counter()
    ttft = None
    async with s.post(url + "/generate", json={**BODY, "stream": stream}) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {await r.text()}")
        if stream:
            async for _ in r.content.iter_any():
                ttft = ttft or time.perf_counter() - start
        else:
            await r.read()
    return time.perf_counter() - start, ttft


async def throughput(urls: list[str], concurrency: int, duration: float) -> tuple[float, int]:
    done = 0
    stop = time.perf_counter() + duration
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as s:

        async def loop(i: int) -> None:
            nonlocal done
            k = i
            while time.perf_counter() < stop:
                await one(s, urls[k % len(urls)])
                k += 1
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(loop(i) for i in range(concurrency)))
        return done / (time.perf_counter() - start), done


async def sequential(urls: list[str], n: int, stream: bool) -> list[tuple[float, float | None]]:
    async with aiohttp.ClientSession() as s:
        for k in range(20):  # warm connections
            await one(s, urls[k % len(urls)], stream)
        return [await one(s, urls[k % len(urls)], stream) for k in range(n)]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def measure(name: str, urls: list[str], router: Process | None, args) -> dict:
    await throughput(urls, args.concurrency, 0.5)  # warm-up
    cpu0 = router.cpu_seconds() if router else 0.0
    rps, n = await throughput(urls, args.concurrency, args.duration)
    cpu = (router.cpu_seconds() - cpu0) / n if router else None
    lat = [t for t, _ in await sequential(urls, args.sequential, stream=False)]
    ttft = [f for _, f in await sequential(urls, args.stream_requests, stream=True)]
    return {
        "target": name,
        "rps": rps,
        "p50_ms": 1e3 * pct(lat, 0.5),
        "p99_ms": 1e3 * pct(lat, 0.99),
        "ttft_ms": 1e3 * statistics.median(ttft),
        "cpu_us_per_req": None if cpu is None else 1e6 * cpu,
    }


# ---- targets -----------------------------------------------------------------------------------------------
def start_ours(worker_urls: list[str], port: int, policy: str, cwd: Path = REPO) -> Process:
    """This checkout's router (or, with `cwd`, the one of the checkout there: `-m` imports from the cwd first)."""
    return spawn(
        [
            sys.executable,
            "-m",
            "sglang_lite.router",
            "--port",
            str(port),
            "--worker-urls",
            *worker_urls,
            "--policy",
            policy,
            "--log-level",
            "warn",
            "--worker-startup-check-interval",
            "1",
        ],
        cwd,
    )


def start_peer(worker_urls: list[str], port: int, policy: str) -> Process:
    return spawn(
        [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *worker_urls,
            "--policy",
            policy,
            "--log-level",
            "warn",
        ]
    )


async def bench_router(name: str, start, worker_urls: list[str], args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(worker_urls, port, args.policy)
    watcher = None
    try:
        await wait_http(url + "/health")
        await _wait_routable(url)
        if args.watch_dashboard and start is start_ours:
            watcher = asyncio.create_task(watch_dashboard(url))
        return await measure(name, [url], proc, args)
    except Exception:
        sys.stderr.write(proc.log.read_text(errors="replace")[-3000:])
        raise
    finally:
        if watcher is not None:
            watcher.cancel()
        proc.stop()


async def watch_dashboard(url: str) -> None:
    """What an open /dashboard page asks of the router: the samples it has not seen, once a second."""
    seq = 0
    async with aiohttp.ClientSession() as s:
        while True:
            async with s.get(f"{url}/dashboard/data?since={seq}") as r:
                data = await r.json()
            seq = data["samples"][-1]["seq"] if data["samples"] else seq
            await asyncio.sleep(1.0)


async def _wait_routable(url: str, timeout: float = 60.0) -> None:
    # A router may answer /health before its workers are registered; wait for a real answer.
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                await one(s, url)
                return
            except (RuntimeError, aiohttp.ClientError):
                await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} never routed a request")


async def start_workers(args) -> tuple[list[Process], list[str]]:
    ports = [free_port() for _ in range(args.workers)]
    workers = [
        spawn(
            [
                sys.executable,
                "-c",
                MOCK_WORKER,
                str(p),
                str(args.token_delay),
                str(args.stream_tokens),
            ]
        )
        for p in ports
    ]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    await asyncio.gather(*(wait_http(u + "/health") for u in urls))
    return workers, urls


async def main(args) -> list[dict]:
    workers, urls = await start_workers(args)
    try:
        rows = [await measure("direct", urls, None, args)]
        rows.append(await bench_router("sglang_lite", start_ours, urls, args))
        if importlib.util.find_spec("sglang_router") is not None and not args.skip_peer:
            rows.append(await bench_router("sglang-router", start_peer, urls, args))
        return rows
    finally:
        for w in workers:
            w.stop()


async def compare(args) -> dict[str, list[float]]:
    """--compare-with: seconds per request of this checkout's router and DIR's, requests interleaved one by one."""
    workers, urls = await start_workers(args)
    routers: dict[str, tuple[Process, str]] = {}
    watcher = None
    try:
        for name, cwd in (("this checkout", REPO), (args.compare_with, Path(args.compare_with))):
            port = free_port()
            routers[name] = start_ours(urls, port, args.policy, cwd), f"http://127.0.0.1:{port}"
        for _, url in routers.values():
            await wait_http(url + "/health")
            await _wait_routable(url)
        if args.watch_dashboard:
            watcher = asyncio.create_task(watch_dashboard(routers["this checkout"][1]))
        latencies: dict[str, list[float]] = {name: [] for name in routers}
        async with aiohttp.ClientSession() as s:
            for k in range(20 + args.sequential):  # the first 20 warm the connections
                # which goes first alternates, so neither gains from its place in the pair
                for name, (_, url) in list(routers.items())[:: 1 if k % 2 else -1]:
                    seconds, _ = await one(s, url)
                    if k >= 20:
                        latencies[name].append(seconds)
        return latencies
    finally:
        if watcher is not None:
            watcher.cancel()
        for proc, _ in routers.values():
            proc.stop()
        for w in workers:
            w.stop()


def report_comparison(latencies: dict[str, list[float]]) -> None:
    print(f"{'router':<40}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'mean ms':>9}")
    for name, values in latencies.items():
        cells = [pct(values, q) for q in (0.5, 0.9, 0.99)] + [statistics.mean(values)]
        print(f"{name:<40}" + "".join(f"{1e3 * v:>9.3f}" for v in cells))


def report(rows: list[dict]) -> None:
    direct = rows[0]
    print(
        f"{'target':<14}{'req/s@64':>10}{'p50 ms':>9}{'p99 ms':>9}{'+p50 ms':>9}{'+p99 ms':>9}"
        f"{'TTFT ms':>9}{'CPU us/req':>12}"
    )
    for r in rows:
        cpu = "-" if r["cpu_us_per_req"] is None else f"{r['cpu_us_per_req']:.0f}"
        print(
            f"{r['target']:<14}{r['rps']:>10.0f}{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}"
            f"{r['p50_ms'] - direct['p50_ms']:>9.2f}{r['p99_ms'] - direct['p99_ms']:>9.2f}"
            f"{r['ttft_ms']:>9.2f}{cpu:>12}"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--duration", type=float, default=3.0, help="seconds of the throughput phase")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument(
        "--sequential", type=int, default=300, help="requests at concurrency 1 for latency"
    )
    p.add_argument("--stream-requests", type=int, default=50)
    p.add_argument("--stream-tokens", type=int, default=4)
    p.add_argument("--token-delay", type=float, default=0.005)
    p.add_argument("--policy", default="round_robin")
    p.add_argument(
        "--skip-peer", action="store_true", help="do not run sglang-router even when installed"
    )
    p.add_argument(
        "--watch-dashboard",
        action="store_true",
        help="read this router's /dashboard/data once a second while measuring it, as an open page does",
    )
    p.add_argument(
        "--compare-with",
        metavar="DIR",
        help="compare this checkout's router with DIR's at concurrency 1, their requests interleaved",
    )
    p.add_argument("--json", action="store_true", help="print rows as JSON too")
    cli = p.parse_args()
    if cli.compare_with:
        report_comparison(asyncio.run(compare(cli)))
        sys.exit(0)
    result = asyncio.run(main(cli))
    report(result)
    if cli.json:
        print(json.dumps(result))
