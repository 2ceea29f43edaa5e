"""Real-system balance check: sglang_lite servers on the CPU behind the router, one run per policy.

Starts `--servers` servers (`--dp-size` ranks each, the tiny model with dummy weights), then for every policy a
router in front of them, replays the same small agentic trace (closed loop) while a BalanceSampler polls every
server's /v1/loads, and prints the balance table. Then it runs the simulator configured like this setup (same
ranks, concurrency and trace shape; the packaged cost model, or with --fit-cost the decode cost fitted from the
sampled loads) and reports whether
both order the policies the same way by outstanding CV.

With `--pd` it starts one prefill server and one decode server (`--dp-size` decode ranks) instead, behind the
router in PD mode (`--pd-disaggregation --dp-aware`, the policy set as the decode policy); the sampler polls the
decode server, whose outstanding requests include its prealloc and transfer queues, and the table also shows the
share of the decode ranks' in-flight requests that wait on their KV transfer.

    python benchmarks/bench_balance.py --out /tmp/bench_balance
    python benchmarks/bench_balance.py --pd --dp-size 2 --out /tmp/bench_balance_pd
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from sglang_lite.bench.balance import BalanceSampler, BalanceStats, LoadSeries, format_table
from sglang_lite.bench.replay import replay_closed_loop, summarize
from sglang_lite.bench.traces import AgenticTraceConfig, agentic_trace
from sglang_lite.utils.process import wait_until_healthy

# Small enough for the tiny model on a CPU, still input-heavy and growing turn by turn.
SMALL_TRACE = AgenticTraceConfig(first_input_mean=300, tool_output_mean=80, output_mean=8, output_max=24,
                                 min_turns=3, max_turns=8, max_context=1500)
# Under --pd: shorter contexts. A long prompt whose KV slots are scattered (a well-used pool) becomes one Mooncake
# block per token, and a write of ~2,300 blocks overflows the TCP transport's lane queue: the transfer fails and
# the decode side waits out --disaggregation-transfer-timeout (docs/pd.md, "A bug found on the way").
PD_TRACE = dataclasses.replace(SMALL_TRACE, first_input_mean=200, tool_output_mean=60, max_context=700)
VOCAB = 4096
SERVER_ARGS = ["--host", "127.0.0.1", "--load-format", "dummy", "--context-length", "2048",
               "--max-running-requests", "16", "--cpu-threads-per-rank", "1"]


@dataclass(frozen=True)
class Cluster:
    """What one setup gives the router (`worker_args`) and which servers the sampler polls."""

    worker_args: list[str]
    sampled_urls: list[str]
    procs: list[subprocess.Popen] = field(default_factory=list)


def trace_config(args: argparse.Namespace) -> AgenticTraceConfig:
    return PD_TRACE if args.pd else SMALL_TRACE


def router_args(policy: str, pd: bool = False) -> list[str]:
    flag = "--decode-policy" if pd else "--policy"
    if policy in ("round_robin", "random"):
        return [flag, policy]
    return [flag, "power_of_two", "--p2c-load-metric", policy]


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


def server_cmd(port: int, args: argparse.Namespace, *extra: str) -> list[str]:
    return [sys.executable, "-m", "sglang_lite.launch_server", "--port", str(port), *SERVER_ARGS,
            "--max-total-tokens", str(args.kv_tokens), *extra]


def launch(cluster: Cluster, cmds: dict[str, list[str]], args: argparse.Namespace, out: Path) -> Cluster:
    """Starts every server (`cmds`: URL -> command) into `cluster.procs` first, so a failed start is cleaned up by
    the caller's `finally`, then waits for all of them."""
    for i, cmd in enumerate(cmds.values()):
        cluster.procs.append(start(cmd, out / f"server{i}.log"))
    for url, proc in zip(cmds, cluster.procs):
        wait_healthy(url, proc, args.startup_timeout)
    return cluster


def start_replicas(args: argparse.Namespace, out: Path, cluster: Cluster) -> Cluster:
    cmds = {}
    for i in range(args.servers):
        port = args.base_port + 1 + i
        cmds[f"http://127.0.0.1:{port}"] = server_cmd(port, args, "--dp-size", str(args.dp_size),
                                                     "--random-seed", str(i))
    cluster.worker_args.extend(["--worker-urls", *cmds])
    cluster.sampled_urls.extend(cmds)
    return launch(cluster, cmds, args, out)


def start_pd(args: argparse.Namespace, out: Path, cluster: Cluster) -> Cluster:
    """One prefill server (one rank) and one decode server with `--dp-size` ranks."""
    prefill_port, decode_port, bootstrap_port = args.base_port + 1, args.base_port + 2, args.base_port + 3
    prefill, decode = f"http://127.0.0.1:{prefill_port}", f"http://127.0.0.1:{decode_port}"
    cmds = {prefill: server_cmd(prefill_port, args, "--disaggregation-mode", "prefill",
                                "--disaggregation-bootstrap-port", str(bootstrap_port)),
            decode: server_cmd(decode_port, args, "--disaggregation-mode", "decode", "--dp-size", str(args.dp_size))}
    cluster.worker_args.extend(["--pd-disaggregation", "--prefill", prefill, str(bootstrap_port), "--decode", decode,
                                "--prefill-policy", "round_robin"])
    cluster.sampled_urls.append(decode)
    return launch(cluster, cmds, args, out)


@dataclass
class InFlightSeries(LoadSeries):
    """LoadSeries that also keeps, per sample, the decode ranks' requests in prealloc and in the transfer queue
    (summed over ranks)."""

    prealloc: list[int] = field(default_factory=list)
    transfer: list[int] = field(default_factory=list)

    def add(self, t: float, per_rank: dict[str, dict]) -> None:
        kept = len(self.times)
        super().add(t, per_rank)
        if len(self.times) > kept:
            entries = [per_rank[r] for r in self.ranks]
            self.prealloc.append(sum(int(e.get("decode_prealloc_queue_reqs", 0)) for e in entries))
            self.transfer.append(sum(int(e.get("decode_transfer_queue_reqs", 0)) for e in entries))

    def waiting_shares(self, min_total_outstanding: int) -> tuple[float, float]:
        """(prealloc, transfer) requests over all outstanding ones, summed over the steady-state samples."""
        keep = [i for i, row in enumerate(self.outstanding) if sum(row) >= min_total_outstanding]
        total = sum(sum(self.outstanding[i]) for i in keep)
        if not total:
            return 0.0, 0.0
        return sum(self.prealloc[i] for i in keep) / total, sum(self.transfer[i] for i in keep) / total


async def run_policy(policy: str, cluster: Cluster, args: argparse.Namespace, out: Path, trace,
                     shares: dict[str, tuple[float, float]]) -> BalanceStats:
    url = f"http://127.0.0.1:{args.base_port}"
    cmd = [sys.executable, "-m", "sglang_lite.router", *cluster.worker_args, "--dp-aware", "--host", "127.0.0.1",
           "--port", str(args.base_port), "--worker-startup-check-interval", str(args.poll_interval),
           *router_args(policy, args.pd)]
    router = start(cmd, out / f"router_{policy}.log")
    try:
        await asyncio.to_thread(wait_healthy, url, router, 60)
        t0 = time.perf_counter()
        sampler = BalanceSampler(cluster.sampled_urls, args.sample_interval)
        sampler.series = InFlightSeries()
        async with sampler:
            results = await replay_closed_loop(url, trace, args.concurrency, VOCAB)
        summary = summarize(results, time.perf_counter() - t0)
        # a stream that ended early (an error event after the 200) still counts as ok in summarize
        summary["short"] = sum(r.ok and r.output_tokens < r.request.output_len for r in results)
    finally:
        stop(router)
    print(f"{policy}: {summary}", flush=True)
    assert summary["failed"] == summary["short"] == 0, f"{policy}: requests failed or ended early; see {out}"
    sampler.series.write_csv(out / f"loads_{policy}.csv")
    sampler.series.plot(out / f"loads_{policy}.png", title=f"{policy}, concurrency {args.concurrency}")
    shares[policy] = sampler.series.waiting_shares(args.concurrency // 2)
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
    # server of its own; the policies still see as many workers as there are real ranks (servers x dp_size, or
    # the decode server's dp_size under --pd). It has no prefix cache either.
    decode_ranks = args.dp_size if args.pd else args.servers * args.dp_size
    cluster = ClusterConfig(num_prefill=1, num_decode=decode_ranks, decode_dp_size=1,
                            gpus_per_server=1, rank_kv_tokens=args.kv_tokens, rank_max_running=16,
                            prefill_cache_tokens=0, poll_interval_s=args.poll_interval,
                            sample_interval_s=args.sample_interval)
    base = SimConfig(concurrency=args.concurrency, duration_s=600.0, warmup_s=30.0, seed=args.seed, cost=cost,
                     cluster=cluster, trace=trace_config(args))
    return {p: simulate(dataclasses.replace(base, policy=p)).balance for p in policies}


def order_by_cv(stats: dict[str, BalanceStats]) -> list[str]:
    return sorted(stats, key=lambda p: stats[p].outstanding_cv)


def format_shares(shares: dict[str, tuple[float, float]]) -> str:
    lines = [f"{'policy':<18}{'in prealloc':>14}{'in transfer':>14}"]
    lines += [f"{p:<18}{pre:>14.1%}{tra:>14.1%}" for p, (pre, tra) in shares.items()]
    return "\n".join(lines)


async def run_real(args: argparse.Namespace, policies: list[str], out: Path,
                   shares: dict[str, tuple[float, float]]) -> dict[str, BalanceStats]:
    trace = agentic_trace(args.sessions, args.seed, trace_config(args))
    cluster = Cluster([], [])
    try:
        (start_pd if args.pd else start_replicas)(args, out, cluster)
        return {p: await run_policy(p, cluster, args, out, trace, shares) for p in policies}
    finally:
        for proc in cluster.procs:
            stop(proc)


async def main_async(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policies = args.policies.split(",")
    shares: dict[str, tuple[float, float]] = {}
    real = await run_real(args, policies, out, shares)
    setup = "1 prefill + 1 decode server (PD)" if args.pd else f"{args.servers} servers"
    print(f"\nreal servers, {setup}, {args.dp_size} DP ranks each (sampled /v1/loads):\n"
          + format_table(real, baseline=policies[0]))
    for p, st in real.items():
        print(f"  {p}: rank batch / mean {[round(x, 2) for x in st.rank_batch_ratio]}, "
              f"busiest share {[round(x, 2) for x in st.busiest_share]}")
    if args.pd:
        print("\nshare of the decode ranks' outstanding requests waiting (steady-state samples):\n"
              + format_shares(shares))
    sim = simulate_like(args, policies, out)
    print("\nsimulator configured like this setup:\n" + format_table(sim, baseline=policies[0]))
    agree = order_by_cv(real) == order_by_cv(sim)
    print(f"\norder by outstanding CV: real {order_by_cv(real)}, simulated {order_by_cv(sim)}: "
          f"{'agree' if agree else 'DISAGREE'}")
    return 0 if agree else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="round_robin,tokens,requests,least_requests")
    p.add_argument("--pd", action="store_true", help="1 prefill + 1 decode server (--dp-size decode ranks)")
    p.add_argument("--servers", type=int, default=2, help="replica mode: servers behind the router")
    p.add_argument("--dp-size", type=int, default=2, help="DP ranks per server (the decode server's under --pd)")
    p.add_argument("--concurrency", type=int, default=None, help="default: 12, or 8 under --pd")
    p.add_argument("--sessions", type=int, default=48)
    p.add_argument("--kv-tokens", type=int, default=16384)
    p.add_argument("--poll-interval", type=float, default=0.5, help="the router's /v1/loads polling period")
    p.add_argument("--sample-interval", type=float, default=0.25, help="the balance sampler's period")
    p.add_argument("--base-port", type=int, default=31000, help="router port; servers use the next ports")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fit-cost", action="store_true", help="simulate with the decode cost fitted to the real run")
    p.add_argument("--out", default="bench_balance_out")
    args = p.parse_args()
    args.concurrency = args.concurrency or (8 if args.pd else 12)
    sys.exit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
