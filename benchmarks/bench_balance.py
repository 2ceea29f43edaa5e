"""Real-system balance check: sglang_lite servers on the CPU behind the router, one run per policy.

Starts `--servers` servers (`--dp-size` ranks each, the tiny model with dummy weights), then for every policy a
router in front of them, replays the same small agentic trace (closed loop) while a BalanceSampler polls every
server's /v1/loads, and prints the balance table. Then it runs the simulator configured like this setup (same
ranks, concurrency and trace shape; the packaged cost model, or with --fit-cost the cost model fitted to the real
runs: the decode step from the replay's TPOTs, and under --pd the prefill rate, the prefix cache and the KV transfer
from the servers' counters, see docs/balance.md "Calibration") and reports, per metric (outstanding CV, busiest
batch, busiest/mean KV), whether both order the policies the same way. --reuse redoes that part from the files a
previous run left in --out.

With `--pd` it starts one prefill server and one decode server (`--dp-size` decode ranks) instead, behind the
router in PD mode (`--pd-disaggregation --dp-aware`, the policy set as the decode policy); the sampler polls the
decode server, whose outstanding requests include its prealloc and transfer queues, and the table also shows the
share of the decode ranks' in-flight requests that wait in those queues (the transfer queue: for the prefill
server, its prefill, then the write) and the share whose data is being written (from the transfers' times).
`--dp-attention` runs both servers as the upstream study deploys them: tensor parallel (`--decode-tp-size`,
`--prefill-tp-size`) with DP attention (`--dp-size` decode ranks, `--prefill-dp-size` prefill ranks), so the
decode ranks meet in the MoE every layer and every decode step waits for the busiest rank; the simulator then
models them as one lockstep decode server. `--repeats N` runs every policy N times (alternating) and reports the
spread, the noise of the table.

    python benchmarks/bench_balance.py --out /tmp/bench_balance
    python benchmarks/bench_balance.py --pd --dp-size 2 --out /tmp/bench_balance_pd
    python benchmarks/bench_balance.py --pd --dp-size 4 --sessions 192 --fit-cost --out /tmp/bb_pd4c  # calibration
    python benchmarks/bench_balance.py --pd --dp-attention --decode-tp-size 4 --dp-size 4 --prefill-tp-size 2 \
        --prefill-dp-size 2 --repeats 2 --out /tmp/bb_study  # the study's cluster
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sglang_lite.protocol.loads import section
from sglang_lite.sim.balance_sampling import BalanceSampler, BalanceStats, LoadSeries, format_table
from sglang_lite.sim.traces import AgenticTraceConfig, agentic_trace
from sglang_lite.utils.process import wait_until_healthy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.tools

from tests.tools.replay import replay_closed_loop, summarize  # noqa: E402

# Small enough for the tiny model on a CPU, still input-heavy and growing turn by turn.
SMALL_TRACE = AgenticTraceConfig(
    first_input_mean=300,
    tool_output_mean=80,
    output_mean=8,
    output_max=24,
    min_turns=3,
    max_turns=8,
    max_context=1500,
)
# Under --pd: shorter contexts, the settings docs/pd.md's figures were taken with (then, long prompts on a
# well-used pool failed to transfer: docs/pd.md, "A bug found on the way", fixed since).
PD_TRACE = dataclasses.replace(
    SMALL_TRACE, first_input_mean=200, tool_output_mean=60, max_context=700
)
VOCAB = 4096
# in each rank's "disaggregation" sub-object of /v1/loads
TRANSFER_TOTALS = ("kv_transfers_total", "kv_transfer_bytes_total", "kv_transfer_seconds_total")
GEN_THROUGHPUT_WINDOW_S = 10.0  # the scheduler's ThroughputMeter window behind gen_throughput
SERVER_ARGS = [
    "--host",
    "127.0.0.1",
    "--load-format",
    "dummy",
    "--context-length",
    "2048",
    "--max-running-requests",
    "16",
    "--cpu-threads-per-rank",
    "1",
]


@dataclass(frozen=True)
class Cluster:
    """What one setup gives the router (`worker_args`) and which servers the sampler polls."""

    worker_args: list[str]
    sampled_urls: list[str]
    # polled for the calibration only (under --pd)
    prefill_urls: list[str] = field(default_factory=list)
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
    return [
        sys.executable,
        "-m",
        "sglang_lite.launch_server",
        "--port",
        str(port),
        *SERVER_ARGS,
        "--max-total-tokens",
        str(args.kv_tokens),
        *(["--page-size", str(args.page_size)] if getattr(args, "page_size", None) else []),
        *extra,
    ]


def launch(
    cluster: Cluster, cmds: dict[str, list[str]], args: argparse.Namespace, out: Path
) -> Cluster:
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
        cmds[f"http://127.0.0.1:{port}"] = server_cmd(
            port, args, "--dp-size", str(args.dp_size), "--random-seed", str(i)
        )
    cluster.worker_args.extend(["--worker-urls", *cmds])
    cluster.sampled_urls.extend(cmds)
    return launch(cluster, cmds, args, out)


def parallel_flags(tp_size: int, dp_size: int, args: argparse.Namespace) -> list[str]:
    """A PD server's parallelism: `--dp-size` replicas, or with `--dp-attention` one TP world of DP-attention
    ranks (whose --max-running-requests is the total: each rank keeps SERVER_ARGS' per-rank figure)."""
    flags = ["--dp-size", str(dp_size)]
    if args.dp_attention:
        per_rank = SERVER_ARGS[SERVER_ARGS.index("--max-running-requests") + 1]
        flags += ["--tp-size", str(tp_size), "--enable-dp-attention"]
        flags += ["--max-running-requests", str(int(per_rank) * dp_size)]
    return flags


def start_pd(args: argparse.Namespace, out: Path, cluster: Cluster) -> Cluster:
    """One prefill server and one decode server with `--dp-size` ranks."""
    prefill_port, decode_port, bootstrap_port = (
        args.base_port + 1,
        args.base_port + 2,
        args.base_port + 3,
    )
    prefill, decode = f"http://127.0.0.1:{prefill_port}", f"http://127.0.0.1:{decode_port}"
    cmds = {
        prefill: server_cmd(
            prefill_port,
            args,
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(bootstrap_port),
            *parallel_flags(args.prefill_tp_size, args.prefill_dp_size, args),
        ),
        decode: server_cmd(
            decode_port,
            args,
            "--disaggregation-mode",
            "decode",
            *parallel_flags(args.decode_tp_size, args.dp_size, args),
        ),
    }
    cluster.worker_args.extend(
        [
            "--pd-disaggregation",
            "--prefill",
            prefill,
            str(bootstrap_port),
            "--decode",
            decode,
            "--prefill-policy",
            "round_robin",
        ]
    )
    cluster.sampled_urls.append(decode)
    cluster.prefill_urls.append(prefill)
    return launch(cluster, cmds, args, out)


@dataclass
class InFlightSeries(LoadSeries):
    """LoadSeries that also keeps, per sample, the decode ranks' requests in prealloc and in the transfer queue
    (summed over ranks)."""

    prealloc: list[int] = field(default_factory=list)
    transfer: list[int] = field(default_factory=list)
    # per sample, TRANSFER_TOTALS over ranks
    transfer_totals: list[list[float]] = field(default_factory=list)

    def add(self, t: float, per_rank: dict[str, dict]) -> None:
        kept = len(self.times)
        super().add(t, per_rank)
        if len(self.times) > kept:
            pd = [section(per_rank[r], "disaggregation") for r in self.ranks]
            self.prealloc.append(sum(int(d.get("decode_prealloc_queue_reqs", 0)) for d in pd))
            self.transfer.append(sum(int(d.get("decode_transfer_queue_reqs", 0)) for d in pd))
            self.add_transfer_totals({r: per_rank[r] for r in self.ranks})

    def add_transfer_totals(self, per_rank: dict[str, dict]) -> None:
        pd = [section(e, "disaggregation") for e in per_rank.values()]
        self.transfer_totals.append([sum(float(d.get(k, 0)) for d in pd) for k in TRANSFER_TOTALS])

    def waiting_shares(self, min_total_outstanding: int) -> tuple[float, float]:
        """(prealloc, transfer) requests over all outstanding ones, summed over the steady-state samples."""
        keep = [i for i, row in enumerate(self.outstanding) if sum(row) >= min_total_outstanding]
        total = sum(sum(self.outstanding[i]) for i in keep)
        if not total:
            return 0.0, 0.0
        return sum(self.prealloc[i] for i in keep) / total, sum(
            self.transfer[i] for i in keep
        ) / total

    def writing_share(self) -> float:
        """Requests whose data is being written, over all outstanding ones, by Little's law over the run: the
        transfers' seconds (as the prefill side timed its writes) per second of wall time is how many are being
        written at a time on average."""
        if len(self.times) < 2 or not self.outstanding:
            return 0.0
        seconds = TRANSFER_TOTALS.index("kv_transfer_seconds_total")
        written = self.transfer_totals[-1][seconds] - self.transfer_totals[0][seconds]
        writing = written / (self.times[-1] - self.times[0])
        outstanding = float(np.mean([sum(row) for row in self.outstanding]))
        return writing / outstanding if outstanding else 0.0


@dataclass
class PrefillSeries:
    """The prefill server's counters, polled by a second BalanceSampler (kept out of the balance statistics):
    per sample, tokens prefilled since start, whether it had work, and its prefix-cache hit rate."""

    times: list[float] = field(default_factory=list)
    prefill_tokens: list[int] = field(default_factory=list)
    busy: list[bool] = field(default_factory=list)
    cache_hit_rate: list[float] = field(default_factory=list)
    poll_failures: Counter = field(default_factory=Counter)

    def add(self, t: float, per_rank: dict[str, dict]) -> None:
        entries = list(per_rank.values())
        pd = [section(e, "disaggregation") for e in entries]
        self.times.append(t)
        self.prefill_tokens.append(sum(int(d.get("num_prefill_tokens", 0)) for d in pd))
        self.busy.append(
            any(
                int(e.get("num_running_reqs", 0))
                + int(e.get("num_waiting_reqs", 0))
                + int(d.get("prefill_prealloc_queue_reqs", 0))
                > 0
                for e, d in zip(entries, pd)
            )
        )
        self.cache_hit_rate.append(max(float(e.get("cache_hit_rate", 0.0)) for e in entries))


async def run_policy(
    policy: str,
    cluster: Cluster,
    args: argparse.Namespace,
    out: Path,
    trace,
    shares: dict[str, tuple[float, float]],
) -> BalanceStats:
    url = f"http://127.0.0.1:{args.base_port}"
    cmd = [
        sys.executable,
        "-m",
        "sglang_lite.router",
        *cluster.worker_args,
        "--dp-aware",
        "--host",
        "127.0.0.1",
        "--port",
        str(args.base_port),
        "--worker-startup-check-interval",
        str(args.poll_interval),
        *router_args(policy, args.pd),
    ]
    router = start(cmd, out / f"router_{policy}.log")
    try:
        await asyncio.to_thread(wait_healthy, url, router, 60)
        t0 = time.perf_counter()
        sampler = BalanceSampler(cluster.sampled_urls, args.sample_interval)
        sampler.series = InFlightSeries()
        prefill_sampler = BalanceSampler(cluster.prefill_urls, args.sample_interval)
        prefill_sampler.series = PrefillSeries()
        async with sampler, prefill_sampler:
            results = await replay_closed_loop(url, trace, args.concurrency, VOCAB)
        summary = summarize(results, time.perf_counter() - t0)
        # a stream that ended early (an error event after the 200) still counts as ok in summarize
        summary["short"] = sum(r.ok and r.output_tokens < r.request.output_len for r in results)
    finally:
        stop(router)
    print(f"{policy}: {summary}", flush=True)
    assert summary["failed"] == summary["short"] == 0, (
        f"{policy}: requests failed or ended early; see {out}"
    )
    sampler.series.write_csv(out / f"loads_{policy}.csv")
    sampler.series.plot(
        out / f"loads_{policy}.png", title=f"{policy}, concurrency {args.concurrency}"
    )
    steady = args.concurrency // 2
    shares[policy] = (*sampler.series.waiting_shares(steady), sampler.series.writing_share())
    stats = sampler.series.stats(min_total_outstanding=steady)
    pre = prefill_sampler.series
    # everything the calibration fits from, so that --reuse can redo the simulator part without servers
    record = {
        "stats": dataclasses.asdict(stats),
        "summary": summary,
        "shares": shares[policy],
        "prompt_tokens": sum(r.request.input_len for r in results if r.ok),
        "requests": [
            (r.request.input_len, r.output_tokens, r.ttft, r.latency) for r in results if r.ok
        ],
        "transfer_totals": sampler.series.transfer_totals,
        "prefill": {
            "times": pre.times,
            "prefill_tokens": pre.prefill_tokens,
            "busy": pre.busy,
            "cache_hit_rate": pre.cache_hit_rate,
        },
    }
    (out / f"real_{policy}.json").write_text(json.dumps(record, default=float))
    return stats


def fit_cost(args: argparse.Namespace, policies: list[str], out: Path):
    """The cost model fitted to the real runs (all policies pooled: the cost is the cluster's, not the policy's),
    and a few lines saying what was fitted from what."""
    from sglang_lite.sim.fit import (
        fit_decode,
        fit_prefill,
        fit_transfer,
        read_observations,
        request_weighted_batch,
        tpot_observations,
    )
    from sglang_lite.sim.sim_config import load_cluster_file

    cost, _ = load_cluster_file()
    records = [json.loads((out / f"real_{p}.json").read_text()) for p in policies]
    notes = []
    # Decode step from the replay's TPOTs: a request's TPOT is the step time of its rank while it decoded, at the
    # batch a decoding request sees (request-weighted mean running, per run) and its own KV.
    obs = np.concatenate(
        [
            tpot_observations(request_weighted_batch(out / f"loads_{p}.csv"), r["requests"])
            for p, r in zip(policies, records)
        ]
    )
    if len(obs) >= 10:
        cost = fit_decode(obs, cost)
        fitted = np.array([cost.rank_step_s(b, k) for b, k, _ in obs])
        notes.append(
            f"decode step: TPOT of {len(obs)} requests; request-weighted batch per run "
            f"{sorted({round(float(b), 2) for b in obs[:, 0]})}; "
            f"TPOT median {np.median(obs[:, 2]) * 1e3:.2f} ms, "
            f"fit residual median |{np.median(np.abs(fitted - obs[:, 2])) * 1e3:.2f}| ms"
        )
    # Cross-check, not used: the loads-based fit (running / gen_throughput per busy rank-sample).
    loads_obs = np.concatenate(
        [read_observations(out / f"loads_{p}.csv", GEN_THROUGHPUT_WINDOW_S) for p in policies]
    )
    if len(loads_obs) >= 3:
        alt = fit_decode(loads_obs, cost)
        notes.append(
            f"  (not used: the /v1/loads fit, {len(loads_obs)} rank-samples averaged over gen_throughput's "
            f"{GEN_THROUGHPUT_WINDOW_S:.0f} s window, gives base {alt.decode_base_s * 1e3:.2f} ms + "
            f"{alt.decode_per_req_s * 1e3:.2f} ms/request + {alt.decode_per_kv_token_s * 1e6:.3f} us/KV "
            f"token; observed steps median {np.median(loads_obs[:, 2]) * 1e3:.2f} ms)"
        )
    if args.pd:
        pre = [r["prefill"] for r in records]
        # runs never join
        times = np.concatenate([np.array(x["times"]) + 1e6 * i for i, x in enumerate(pre)])
        toks = np.concatenate([np.array(x["prefill_tokens"], dtype=float) for x in pre])
        busy = np.concatenate([np.array(x["busy"], dtype=bool) for x in pre])
        busy_joint = busy.copy()
        starts = np.cumsum([0] + [len(x["times"]) for x in pre])[:-1]
        busy_joint[starts] = False  # no interval across two runs
        cost = fit_prefill(times, toks, busy_joint, cost)
        hit = max(x["cache_hit_rate"][-1] for x in pre if x["cache_hit_rate"])
        notes.append(
            f"prefill: {int(np.diff(toks)[busy_joint[:-1] & busy_joint[1:]].clip(0).sum())} tokens in busy "
            f"intervals, {np.mean(busy):.0%} of samples busy; prefix-cache hit rate at the end {hit:.1%}"
        )
        tt = [np.array(r["transfer_totals"], dtype=float).reshape(-1, 3) for r in records]
        counts = np.concatenate([np.diff(t[:, 0], prepend=t[0, 0]) for t in tt]).cumsum()
        nbytes = np.concatenate([np.diff(t[:, 1], prepend=t[0, 1]) for t in tt]).cumsum()
        secs = np.concatenate([np.diff(t[:, 2], prepend=t[0, 2]) for t in tt]).cumsum()
        prompt_tokens = sum(int(r["prompt_tokens"]) for r in records)
        cost = fit_transfer(counts, nbytes, secs, prompt_tokens, cost)
        notes.append(
            f"transfer: {int(counts[-1])} transfers, {nbytes[-1] / max(counts[-1], 1):,.0f} bytes and "
            f"{secs[-1] / max(counts[-1], 1) * 1e3:.2f} ms each (the prefill side's write time)"
        )
    else:
        hit = 0.0
    return cost, hit, notes


def simulate_like(
    args: argparse.Namespace, policies: list[str], out: Path, cost=None, prefix_cache: bool = False
):
    from sglang_lite.sim.cluster import simulate
    from sglang_lite.sim.sim_config import ClusterConfig, SimConfig, load_cluster_file

    cost = cost or load_cluster_file()[0]
    # Without DP attention sglang_lite's ranks step independently, so each rank is simulated as a decode server of
    # its own; the policies still see as many workers as there are real ranks (servers x dp_size, or the decode
    # server's dp_size under --pd). With --dp-attention the decode ranks step together: one decode server of
    # dp_size lockstep ranks, as the study's. The prefix cache is on only if the real prefill server hit its own.
    decode_ranks = args.dp_size if args.pd else args.servers * args.dp_size
    lockstep = args.pd and args.dp_attention
    cluster = ClusterConfig(
        num_prefill=1,
        num_decode=1 if lockstep else decode_ranks,
        decode_dp_size=decode_ranks if lockstep else 1,
        gpus_per_server=1,
        rank_kv_tokens=args.kv_tokens,
        rank_max_running=16,
        prefill_cache_tokens=args.kv_tokens if prefix_cache else 0,
        poll_interval_s=args.poll_interval,
        sample_interval_s=args.sample_interval,
    )
    base = SimConfig(
        concurrency=args.concurrency,
        duration_s=args.sim_duration,
        warmup_s=30.0,
        seed=args.seed,
        cost=cost,
        cluster=cluster,
        trace=trace_config(args),
    )
    return {p: simulate(dataclasses.replace(base, policy=p)) for p in policies}


METRICS = ("outstanding_cv", "busiest_batch", "busiest_over_mean_kv")


def order_by(stats: dict[str, BalanceStats], metric: str) -> list[str]:
    return sorted(stats, key=lambda p: getattr(stats[p], metric))


def pairs_agreeing(real: list[str], sim: list[str]) -> tuple[int, int]:
    pairs = [(a, b) for i, a in enumerate(real) for b in real[i + 1 :]]
    return sum(sim.index(a) < sim.index(b) for a, b in pairs), len(pairs)


def format_shares(shares: dict[str, tuple[float, ...]]) -> str:
    """Per policy: in prealloc, in the transfer queue (waiting for the prefill server, being prefilled, or being
    written), and being written (``InFlightSeries.writing_share``)."""
    lines = [f"{'policy':<18}{'in prealloc':>14}{'in transfer':>14}{'being written':>16}"]
    for p, (pre, tra, *writing) in shares.items():
        written = f"{writing[0]:.1%}" if writing else "-"
        lines.append(f"{p:<18}{pre:>14.1%}{tra:>14.1%}{written:>16}")
    return "\n".join(lines)


async def run_real(
    args: argparse.Namespace, policies: list[str], out: Path, shares: dict[str, tuple[float, float]]
) -> dict[str, BalanceStats]:
    trace = agentic_trace(args.sessions, args.seed, trace_config(args))
    cluster = Cluster([], [])
    try:
        (start_pd if args.pd else start_replicas)(args, out, cluster)
        return {p: await run_policy(p, cluster, args, out, trace, shares) for p in policies}
    finally:
        for proc in cluster.procs:
            stop(proc)


def load_real(policies: list[str], out: Path, shares: dict[str, tuple[float, float]]):
    real, summaries = {}, {}
    for p in policies:
        record = json.loads((out / f"real_{p}.json").read_text())
        st = record["stats"]
        real[p] = BalanceStats(
            **{
                **st,
                "rank_batch_ratio": tuple(st["rank_batch_ratio"]),
                "busiest_share": tuple(st["busiest_share"]),
            }
        )
        summaries[p], shares[p] = record["summary"], tuple(record["shares"])
    return real, summaries


STUDY_COLUMNS = (
    ("output tok/s", lambda s, b: s["output_tok_s"]),
    ("TPOT p50 ms", lambda s, b: s["tpot_p50_s"] * 1e3),
    ("TPOT p90 ms", lambda s, b: s["tpot_p90_s"] * 1e3),
    ("outstanding CV", lambda s, b: b.outstanding_cv),
    ("running CV", lambda s, b: b.running_cv),
    ("busiest batch", lambda s, b: b.busiest_batch),
    ("busiest/mean KV", lambda s, b: b.busiest_over_mean_kv),
)


def study_table(reps: list[tuple[dict[str, BalanceStats], dict[str, dict]]]) -> str:
    """The upstream study's columns per policy: the mean over the repeats, and with several, +- half their range
    (the run-to-run noise)."""
    lines = [f"{'policy':<16}" + "".join(f"{name:>20}" for name, _ in STUDY_COLUMNS)]
    for policy in reps[0][0]:
        cells = []
        for _, value in STUDY_COLUMNS:
            values = [value(summaries[policy], real[policy]) for real, summaries in reps]
            spread = f" +-{(max(values) - min(values)) / 2:.3g}" if len(values) > 1 else ""
            cells.append(f"{np.mean(values):.3g}{spread}".rjust(20))
        lines.append(f"{policy:<16}" + "".join(cells))
    return "\n".join(lines)


def mean_stats(stats: list[BalanceStats]) -> BalanceStats:
    """The repeats' balance figures averaged (what the simulator's orderings are compared with)."""
    if len(stats) == 1:
        return stats[0]
    fields = {}
    for name in ("outstanding_cv", "running_cv", "busiest_batch", "busiest_over_mean_kv"):
        fields[name] = float(np.mean([getattr(s, name) for s in stats]))
    return dataclasses.replace(stats[0], **fields, num_samples=sum(s.num_samples for s in stats))


async def main_async(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policies = args.policies.split(",")
    runs = [out / f"run{k}" for k in range(args.repeats)] if args.repeats > 1 else [out]
    if not args.reuse:
        for run_out in runs:  # each repeat runs every policy once: the policies alternate
            run_out.mkdir(parents=True, exist_ok=True)
            await run_real(args, policies, run_out, {})
    reps = []
    shares: dict[str, tuple[float, float]] = {}
    for run_out in runs:
        real, summaries = load_real(policies, run_out, shares)
        reps.append((real, summaries))
    real = {p: mean_stats([r[p] for r, _ in reps]) for p in policies}
    summaries = reps[0][1]
    if args.pd:
        setup = f"1 prefill + 1 decode server (PD), {args.dp_size} decode DP ranks"
        if args.dp_attention:
            setup += (
                f" (TP {args.decode_tp_size}, DP attention; prefill TP {args.prefill_tp_size} with "
                f"{args.prefill_dp_size} DP-attention ranks)"
            )
    else:
        setup = f"{args.servers} servers, {args.dp_size} DP ranks each"
    print(f"\nreal servers, {setup} (sampled /v1/loads, {len(runs)} run(s) per policy):")
    print(study_table(reps))
    print("\n" + format_table(real, baseline=policies[0]))
    for p, st in real.items():
        print(
            f"  {p}: rank batch / mean {[round(x, 2) for x in st.rank_batch_ratio]}, "
            f"busiest share {[round(x, 2) for x in st.busiest_share]}"
        )
    if args.pd:
        print(
            "\nshare of the decode ranks' outstanding requests waiting (steady-state samples, last run):\n"
            + format_shares(shares)
        )
    out = runs[0]  # the calibration reads the first run's files
    cost, hit = None, 0.0
    if args.fit_cost:
        cost, hit, notes = fit_cost(args, policies, out)
        print("\nfitted to the real runs (all policies pooled):\n  " + "\n  ".join(notes))
        print("  cost: " + ", ".join(f"{k}={v:.4g}" for k, v in dataclasses.asdict(cost).items()))
    results = simulate_like(args, policies, out, cost, prefix_cache=hit > 0.05)
    if args.fit_cost and args.pd:
        # What the fitted prefill rate and write time leave out of TTFT (router hops, the bootstrap handshake, the
        # decode rank noticing the data, the first token's way back): the mean gap of TTFT p50 real - simulated,
        # added once as a per-request latency of the transfer (it delays each request, it occupies no server),
        # then simulated again. One correction from TTFT, not a search over the balance table.
        gap = float(np.mean([summaries[p]["ttft_p50_s"] - results[p].ttft_p50 for p in policies]))
        if gap > 0:
            cost = dataclasses.replace(cost, transfer_latency_s=cost.transfer_latency_s + gap)
            print(
                f"  TTFT p50 real - simulated (mean over policies) {gap * 1e3:.1f} ms: transfer_latency_s -> "
                f"{cost.transfer_latency_s * 1e3:.1f} ms, simulated again"
            )
            results = simulate_like(args, policies, out, cost, prefix_cache=hit > 0.05)
    sim = {p: r.balance for p, r in results.items()}
    print(
        f"\nsimulator configured like this setup ({'fitted' if args.fit_cost else 'packaged'} cost model, "
        f"{args.sim_duration:.0f} s, seed {args.seed}):\n" + format_table(sim, baseline=policies[0])
    )
    print(
        f"\n{'policy':<18}{'TTFT p50 s real/sim':>22}{'TPOT p50 ms real/sim':>24}{'in transfer real/sim':>24}"
    )
    for p, r in results.items():
        s = summaries[p]
        print(
            f"{p:<18}{s['ttft_p50_s']:>11.3f} / {r.ttft_p50:<8.3f}{s['tpot_p50_s'] * 1e3:>13.2f} / "
            f"{r.tpot_p50 * 1e3:<8.2f}{shares[p][1]:>14.1%} / {np.mean(r.transfer_share or [0.0]):<6.1%}"
        )
    all_agree = True
    for metric in METRICS:
        r_order, s_order = order_by(real, metric), order_by(sim, metric)
        agree = r_order == s_order
        all_agree &= agree
        ok, n = pairs_agreeing(r_order, s_order)
        print(
            f"order by {metric} (lowest first): real {r_order}, simulated {s_order}: "
            f"{'agree' if agree else 'DISAGREE'} ({ok}/{n} pairs)"
        )
    return 0 if all_agree else 1


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--policies", default="round_robin,tokens,requests,least_requests")
    p.add_argument(
        "--pd", action="store_true", help="1 prefill + 1 decode server (--dp-size decode ranks)"
    )
    p.add_argument(
        "--dp-attention",
        action="store_true",
        help="under --pd: both servers tensor parallel with DP attention (their ranks meet in the MoE)",
    )
    p.add_argument("--decode-tp-size", type=int, default=1, help="under --pd --dp-attention")
    p.add_argument("--prefill-tp-size", type=int, default=1, help="under --pd --dp-attention")
    p.add_argument("--prefill-dp-size", type=int, default=1, help="under --pd: prefill DP ranks")
    p.add_argument(
        "--repeats", type=int, default=1, help="runs of every policy (their spread is the noise)"
    )
    p.add_argument("--servers", type=int, default=2, help="replica mode: servers behind the router")
    p.add_argument(
        "--dp-size",
        type=int,
        default=2,
        help="DP ranks per server (the decode server's under --pd)",
    )
    p.add_argument("--concurrency", type=int, default=None, help="default: 12, or 8 under --pd")
    p.add_argument("--sessions", type=int, default=48)
    p.add_argument("--kv-tokens", type=int, default=16384)
    p.add_argument("--page-size", type=int, default=None, help="the servers' --page-size")
    p.add_argument(
        "--poll-interval", type=float, default=0.5, help="the router's /v1/loads polling period"
    )
    p.add_argument(
        "--sample-interval", type=float, default=0.25, help="the balance sampler's period"
    )
    p.add_argument(
        "--base-port", type=int, default=31000, help="router port; servers use the next ports"
    )
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fit-cost",
        action="store_true",
        help="simulate with the cost model fitted to the real runs (decode step; under --pd also the "
        "prefill rate and the KV transfer)",
    )
    p.add_argument(
        "--reuse",
        action="store_true",
        help="start no servers: redo the simulator part from the files a previous run left in --out",
    )
    p.add_argument("--sim-duration", type=float, default=600.0, help="simulated seconds per policy")
    p.add_argument("--out", default="bench_balance_out")
    args = p.parse_args()
    args.concurrency = args.concurrency or (8 if args.pd else 12)
    sys.exit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
