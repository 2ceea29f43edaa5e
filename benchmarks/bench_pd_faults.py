"""The PD fault run: 24 clients sending greedy requests through our router (``--pd-disaggregation --dp-aware``) to a
prefill server and a decode server with two DP ranks (the built-in model, default settings), while, one after the
other: a decode rank is killed (kill -9) mid-transfer, the whole prefill server is stopped (SIGSTOP) for 10 s, and
the prefill server's scheduler is killed. Every answer is compared with a plain server's on the same prompts.

Prints, per fault (the requests that ended between it and the next) and in all: requests, completed, corrupted
(an answer that differs from the plain server's), failures by status, unclean failures (not a 502/503 with the
JSON error body), hung requests (past ``--hung-s``), the slowest request, and how long after the last fault a fresh
request of every prompt first came back right.
Plots every request (when it started, how long it took, its status) with the faults marked.

    python benchmarks/bench_pd_faults.py --out /tmp/pd_faults --plot docs/pd_faults.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from sglang_lite.assets import TINY_MODEL_DIR
from sglang_lite.config import ModelConfig
from sglang_lite.utils.process import wait_until_healthy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.tools

from tests.tools.pd_faults import (
    Load,
    kill_rank,
    stop_for,
    verdicts,
    wait_for,
)

COMMON = ["--host", "127.0.0.1", "--cpu-threads-per-rank", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """Processes started in sessions of their own (a server's group can be stopped whole), all ended by close()."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, *args: str) -> tuple[subprocess.Popen, str]:
        port = free_port()
        cmd = [sys.executable, "-m", *args, "--port", str(port)]
        log = open(self.out / f"{name}.log", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc, f"http://127.0.0.1:{port}"

    def server(self, name: str, *flags: str) -> tuple[subprocess.Popen, str]:
        proc, url = self.start(name, "sglang_lite.launch_server", *COMMON, *flags)
        if not wait_until_healthy(url, proc, 300):
            raise RuntimeError(f"{name} did not start: see {self.out / name}.log")
        return proc, url

    def close(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(30)


def prompts(n: int, seed: int) -> list[list[int]]:
    vocab = ModelConfig.from_hf(TINY_MODEL_DIR).vocab_size
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 400))] for _ in range(n)]


async def references(url: str, load_prompts: list[list[int]], params: dict) -> list[list[int]]:
    async with aiohttp.ClientSession() as s:
        outcomes = await Load(url, load_prompts, params).every_prompt(s)
    assert all(o.status == 200 for o in outcomes), [o.body for o in outcomes if o.status != 200]
    return [o.body["output_ids"] for o in sorted(outcomes, key=lambda o: o.prompt)]


async def fault_run(args, prefill, decode, router, load_prompts, refs) -> dict:
    params = {"max_new_tokens": args.new_tokens, "temperature": 0.0, "ignore_eos": True}
    (prefill_proc, prefill_url), decode_url = prefill, decode
    faults: list[tuple[str, float]] = []
    async with aiohttp.ClientSession() as s:
        load = Load(router, load_prompts, params, timeout_s=args.hung_s * 2)
        clients = [
            asyncio.create_task(load.client(s, i, args.clients)) for i in range(args.clients)
        ]

        async def settle() -> None:  # load on until every client has finished another request
            done = sum(o.status == 200 for o in load.outcomes)
            await wait_for(lambda: load.completed(done + args.clients), timeout=120)

        try:
            await settle()
            faults.append(("decode rank 0 killed", await kill_rank(s, decode_url, 0, 300)))
            await settle()
            faults.append(
                ("prefill stopped 10 s", await stop_for(prefill_proc.pid, 10, group=True))
            )
            await settle()
            faults.append(("prefill scheduler killed", await kill_rank(s, prefill_url, 0, 300)))
            await settle()
        finally:
            load.stop.set()
            await asyncio.wait_for(asyncio.gather(*clients, return_exceptions=True), 300)
        last = faults[-1][1]
        fresh = Load(router, load_prompts, params)
        right = False
        while not right and time.monotonic() - last < 300:
            wave = await fresh.every_prompt(s)
            right = all(o.status == 200 and o.body["output_ids"] == refs[o.prompt] for o in wave)
        return {
            "load": load,
            "faults": faults,
            "fresh_right_after_s": time.monotonic() - last if right else None,
        }


def table(load: Load, faults: list[tuple[str, float]], refs, hung_s: float) -> str:
    bounds = [f[1] for f in faults] + [float("inf")]
    phases = [("before the faults", float("-inf"), bounds[0])]
    phases += [(name, start, bounds[i + 1]) for i, (name, start) in enumerate(faults)]
    rows = [
        f"{'phase':26} | requests | completed | corrupted | failed (status: n) | unclean | hung | slowest s"
    ]
    for name, start, end in phases + [("all", float("-inf"), float("inf"))]:
        seen = verdicts([o for o in load.outcomes if start <= o.ended < end], refs, hung_s)
        failed = ", ".join(f"{k}: {v}" for k, v in sorted(seen["failed"].items())) or "-"
        rows.append(
            f"{name:26} | {seen['requests']:8} | {seen['completed']:9} | {len(seen['corrupted']):9} | "
            f"{failed:18} | {len(seen['unclean']):7} | {len(seen['hung']):4} | {seen['slowest_s']:9.1f}"
        )
    return "\n".join(rows)


def plot(load: Load, faults: list[tuple[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(o.started for o in load.outcomes)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for status, color in ((200, "tab:green"), (502, "tab:orange"), (503, "tab:red")):
        xs = [(o.started - t0, o.seconds) for o in load.outcomes if o.status == status]
        if xs:
            ax.scatter(*zip(*xs), s=6, color=color, label=str(status))
    others = [(o.started - t0, o.seconds) for o in load.outcomes if o.status not in (200, 502, 503)]
    if others:
        ax.scatter(*zip(*others), s=12, color="black", marker="x", label="other")
    for name, at in faults:
        ax.axvline(at - t0, color="grey", linestyle="--")
        ax.text(at - t0, ax.get_ylim()[1] * 0.95, " " + name, rotation=90, va="top", fontsize=8)
    ax.set_xlabel("request sent (s from the start)")
    ax.set_ylabel("request time (s)")
    ax.set_title("PD fault run: every request through the router, by status")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument(
        "--hung-s", type=float, default=60.0, help="a request slower than this hung"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="/tmp/pd_faults")
    parser.add_argument("--plot", default=None, help="PNG of every request")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_prompts = prompts(args.prompts, args.seed)
    params = {"max_new_tokens": args.new_tokens, "temperature": 0.0, "ignore_eos": True}
    cluster = Cluster(out)
    try:
        plain = cluster.server("plain")
        refs = asyncio.run(references(plain[1], load_prompts, params))
        plain[0].kill()
        bootstrap = str(free_port())
        prefill = cluster.server(
            "prefill",
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            bootstrap,
        )
        decode = cluster.server("decode", "--disaggregation-mode", "decode", "--dp-size", "2")
        router_proc, router = cluster.start(
            "router",
            *("sglang_lite.router", "--pd-disaggregation", "--dp-aware", "--host", "127.0.0.1"),
            *("--prefill", prefill[1], bootstrap, "--decode", decode[1]),
        )
        if not wait_until_healthy(router, router_proc, 60):
            raise RuntimeError("the router did not start")
        result = asyncio.run(fault_run(args, prefill, decode[1], router, load_prompts, refs))
    finally:
        cluster.close()
    load, faults = result["load"], result["faults"]
    print(table(load, faults, refs, args.hung_s))
    after = result["fresh_right_after_s"]
    print(
        f"every prompt answered right again {after:.1f} s after the last fault"
        if after
        else "never right again"
    )
    records = [o.__dict__ for o in load.outcomes]
    (out / "outcomes.json").write_text(
        json.dumps({"faults": faults, "outcomes": records}, default=str)
    )
    if args.plot:
        plot(load, faults, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
