"""Real-system balance check: sglang_lite servers on the CPU behind the router, one run per policy.

Starts `--servers` servers (`--dp-size` ranks each, the tiny model with dummy weights), then for every policy a
router in front of them, replays the same small agentic trace (closed loop) while a BalanceSampler polls every
server's /v1/loads, and prints the balance table. Then it runs the simulator configured like this setup (same
ranks, concurrency and trace shape; the packaged cost model, or with --fit-cost the decode cost fitted from the
sampled loads) and reports whether
both order the policies the same way by outstanding CV.

    python benchmarks/bench_balance.py --out /tmp/bench_balance
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import subprocess
import sys
import time
from pathlib import Path

from sglang_lite.bench.balance import BalanceSampler, BalanceStats, format_table
from sglang_lite.bench.replay import replay_closed_loop, summarize
from sglang_lite.bench.traces import AgenticTraceConfig, agentic_trace
from sglang_lite.utils.process import wait_until_healthy

# Small enough for the tiny model on a CPU, still input-heavy and growing turn by turn.
SMALL_TRACE = AgenticTraceConfig(first_input_mean=300, tool_output_mean=80, output_mean=8, output_max=24,
                                 min_turns=3, max_turns=8, max_context=1500)
VOCAB = 4096


def router_args(policy: str) -> list[str]:
    if policy in ("round_robin", "random"):
        return ["--policy", policy]
    return ["--policy", "power_of_two", "--p2c-load-metric", policy]


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    if wait_until_healthy(url, proc, timeout):
        return
    if proc.poll() is not None:
        raise RuntimeError(f"{url}: process exited with {proc.returncode}")
    raise TimeoutError(f"{url} not healthy after {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


def start_servers(args: argparse.Namespace, out: Path) -> tuple[list[str], list[subprocess.Popen]]:
    urls, procs = [], []
    for i in range(args.servers):
        port = args.base_port + 1 + i
        cmd = [sys.executable, "-m", "sglang_lite.launch_server", "--dp-size", str(args.dp_size), "--port", str(port),
               "--load-format", "dummy", "--context-length", "2048", "--max-total-tokens", str(args.kv_tokens),
               "--max-running-requests", "16", "--random-seed", str(i)]
        procs.append(start(cmd, out / f"server{i}.log"))
        urls.append(f"http://127.0.0.1:{port}")
    for url, proc in zip(urls, procs):
        wait_healthy(url, proc, args.startup_timeout)
    return urls, procs


async def run_policy(policy: str, server_urls: list[str], args: argparse.Namespace, out: Path, trace) -> BalanceStats:
    url = f"http://127.0.0.1:{args.base_port}"
    cmd = [sys.executable, "-m", "sglang_lite.router", "--worker-urls", *server_urls, "--dp-aware", "--port",
           str(args.base_port), "--worker-startup-check-interval", str(args.poll_interval), *router_args(policy)]
    router = start(cmd, out / f"router_{policy}.log")
    try:
        await asyncio.to_thread(wait_healthy, url, router, 60)
        t0 = time.perf_counter()
        async with BalanceSampler(server_urls, args.sample_interval) as sampler:
            results = await replay_closed_loop(url, trace, args.concurrency, VOCAB)
        summary = summarize(results, time.perf_counter() - t0)
    finally:
        stop(router)
    print(f"{policy}: {summary}", flush=True)
    assert summary["failed"] == 0, f"{policy}: {summary['failed']} requests failed; see {out}"
    sampler.series.write_csv(out / f"loads_{policy}.csv")
    sampler.series.plot(out / f"loads_{policy}.png", title=f"{policy}, concurrency {args.concurrency}")
    return sampler.series.stats(min_total_outstanding=args.concurrency // 2)


def simulate_like(args: argparse.Namespace, policies: list[str], out: Path) -> dict[str, BalanceStats]:
    from sglang_lite.sim.cluster import simulate
    from sglang_lite.sim.config import ClusterConfig, SimConfig, load_cluster_file
    from sglang_lite.sim.fit import fit_decode, read_observations

    cost, _ = load_cluster_file()
    obs = read_observations(out / f"loads_{policies[0]}.csv")
    if args.fit_cost and len(obs) >= 10:
        # Off by default: a busy CPU rank's gen_throughput also pays for the prefills it runs between decode
        # steps, so the fitted "decode step" grows with KV far faster than decoding does, and that regime
        # (steps of ~1 s, dominated by context length) changes how round_robin and tokens compare.
        cost = fit_decode(obs, cost)
    # sglang_lite's CPU ranks step independently (no DP-attention lockstep), so each rank is simulated as a decode
    # server of its own; the policies still see servers x dp_size workers. It has no prefix cache either.
    cluster = ClusterConfig(num_prefill=1, num_decode=args.servers * args.dp_size, decode_dp_size=1,
                            gpus_per_server=1, rank_kv_tokens=args.kv_tokens, rank_max_running=16,
                            prefill_cache_tokens=0, poll_interval_s=args.poll_interval,
                            sample_interval_s=args.sample_interval)
    base = SimConfig(concurrency=args.concurrency, duration_s=600.0, warmup_s=30.0, seed=args.seed, cost=cost,
                     cluster=cluster, trace=SMALL_TRACE)
    return {p: simulate(dataclasses.replace(base, policy=p)).balance for p in policies}


def order_by_cv(stats: dict[str, BalanceStats]) -> list[str]:
    return sorted(stats, key=lambda p: stats[p].outstanding_cv)


async def main_async(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policies = args.policies.split(",")
    trace = agentic_trace(args.sessions, args.seed, SMALL_TRACE)
    server_urls, procs = start_servers(args, out)
    try:
        real = {p: await run_policy(p, server_urls, args, out, trace) for p in policies}
    finally:
        for proc in procs:
            stop(proc)
    print("\nreal servers (sampled /v1/loads):\n" + format_table(real, baseline=policies[0]))
    for p, st in real.items():
        print(f"  {p}: rank batch / mean {[round(x, 2) for x in st.rank_batch_ratio]}, "
              f"busiest share {[round(x, 2) for x in st.busiest_share]}")
    sim = simulate_like(args, policies, out)
    print("\nsimulator configured like this setup:\n" + format_table(sim, baseline=policies[0]))
    agree = order_by_cv(real) == order_by_cv(sim)
    print(f"\norder by outstanding CV: real {order_by_cv(real)}, simulated {order_by_cv(sim)}: "
          f"{'agree' if agree else 'DISAGREE'}")
    return 0 if agree else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="round_robin,tokens,requests,least_requests")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--dp-size", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--sessions", type=int, default=48)
    p.add_argument("--kv-tokens", type=int, default=16384)
    p.add_argument("--poll-interval", type=float, default=0.5, help="the router's /v1/loads polling period")
    p.add_argument("--sample-interval", type=float, default=0.25, help="the balance sampler's period")
    p.add_argument("--base-port", type=int, default=31000, help="router port; servers use the next ports")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fit-cost", action="store_true", help="simulate with the decode cost fitted to the real run")
    p.add_argument("--out", default="bench_balance_out")
    sys.exit(asyncio.run(main_async(p.parse_args())))


if __name__ == "__main__":
    main()
