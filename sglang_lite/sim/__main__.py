"""`python -m sglang_lite.sim {run,compare,fit}`: the PD cluster simulator's command line.

    python -m sglang_lite.sim compare --policies round_robin,tokens,requests,least_requests \
        --concurrency 192,256,384,512 --out sim_out
    python -m sglang_lite.sim run --policy least_requests --concurrency 256 --duration 600
    python -m sglang_lite.sim fit balance.csv --out fitted.json
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from sglang_lite.sim.config import (
    SimConfig,
    load_cluster_file,
    load_trace_config,
    save_cluster_file,
)


def base_config(args: argparse.Namespace) -> SimConfig:
    cost, cluster = load_cluster_file(args.cluster_file)
    overrides = {
        k: getattr(args, k)
        for k in ("poll_interval_s", "decode_dp_size", "num_decode", "num_prefill")
        if getattr(args, k) is not None
    }
    cluster = dataclasses.replace(cluster, **overrides)
    warmup = args.warmup if args.warmup is not None else min(300.0, args.duration / 6)
    return SimConfig(
        duration_s=args.duration,
        warmup_s=warmup,
        seed=args.seed,
        cost=cost,
        cluster=cluster,
        trace=load_trace_config(args.cluster_file),
        prefill_policy=args.prefill_policy,
    )


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cluster-file", default=None, help="cost model + cluster JSON (default: the packaged one)"
    )
    p.add_argument("--duration", type=float, default=3600.0, help="simulated seconds per run")
    p.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds excluded from metrics (default min(300, duration/6))",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--poll-interval", dest="poll_interval_s", type=float, default=None)
    p.add_argument("--dp-size", dest="decode_dp_size", type=int, default=None)
    p.add_argument("--num-decode", type=int, default=None)
    p.add_argument("--num-prefill", type=int, default=None)
    p.add_argument(
        "--prefill-policy",
        default=SimConfig.prefill_policy,
        help="how the router picks a prefill server (a compare label, as --policies)",
    )
    p.add_argument("--out", default=None, help="folder for plots and CSV")


def cmd_compare(args: argparse.Namespace) -> None:
    from sglang_lite.sim.compare import format_table, plot_grid, plot_ranks, run_grid

    policies = args.policies.split(",")
    concs = [int(c) for c in args.concurrency.split(",")]
    t0 = time.perf_counter()
    results = run_grid(base_config(args), policies, concs, args.processes)
    elapsed = time.perf_counter() - t0
    table = format_table(results, baseline=policies[0])
    print(table)
    cpu = sum(r.cpu_s for r in results.values())
    print(
        f"\n{len(results)} runs of {args.duration:.0f} simulated s: {elapsed:.1f} s wall with {args.processes} "
        f"processes, {cpu:.1f} s CPU in the simulations"
    )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.md").write_text(table + "\n")
        plot_grid(results, out / "compare.png")
        for p in policies:
            plot_ranks(results[(p, concs[-1])], out / f"ranks_{p}_{concs[-1]}.png")


def cmd_run(args: argparse.Namespace) -> None:
    from sglang_lite.sim.cluster import simulate
    from sglang_lite.sim.compare import plot_ranks

    cfg = dataclasses.replace(base_config(args), policy=args.policy, concurrency=args.concurrency)
    result = simulate(cfg)
    for k, v in result.row().items():
        print(f"{k:>22}: {v:.4f}")
    print(f"{'completed':>22}: {result.completed}")
    print(f"{'transfer_share':>22}: {[round(x, 3) for x in result.transfer_share]}")
    print(f"{'rank_batch_ratio':>22}: {[round(x, 3) for x in result.balance.rank_batch_ratio]}")
    print(f"{'busiest_share':>22}: {[round(x, 3) for x in result.balance.busiest_share]}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        plot_ranks(result, Path(args.out) / f"ranks_{args.policy}_{args.concurrency}.png")


def cmd_fit(args: argparse.Namespace) -> None:
    from sglang_lite.sim.fit import fit_decode, read_observations

    cost, cluster = load_cluster_file(args.cluster_file)
    fitted = fit_decode(read_observations(args.csv, args.window), cost)
    print({k: v for k, v in dataclasses.asdict(fitted).items() if k.startswith("decode_")})
    if args.out:
        save_cluster_file(
            args.out,
            fitted,
            cluster,
            f"decode cost fitted from {args.csv}",
            load_trace_config(args.cluster_file),
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_lite.sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    compare = sub.add_parser("compare", help="policies x concurrencies table")
    add_common(compare)
    compare.add_argument("--policies", default="round_robin,tokens,requests,least_requests")
    compare.add_argument("--concurrency", default="192,256,384,512")
    compare.add_argument("--processes", type=int, default=2)
    compare.set_defaults(func=cmd_compare)
    run = sub.add_parser("run", help="one simulation")
    add_common(run)
    run.add_argument("--policy", default="least_requests")
    run.add_argument("--concurrency", type=int, default=256)
    run.set_defaults(func=cmd_run)
    fit = sub.add_parser("fit", help="fit the decode cost model to a balance sampler CSV")
    fit.add_argument("csv")
    fit.add_argument("--cluster-file", default=None)
    fit.add_argument(
        "--window",
        type=float,
        default=0.0,
        help="average running and KV over this trailing window (s), the window of gen_throughput "
        "(10 for sglang_lite servers); 0: use each sample as it is",
    )
    fit.add_argument("--out", default=None, help="write the fitted cluster JSON here")
    fit.set_defaults(func=cmd_fit)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
