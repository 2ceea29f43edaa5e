"""`python -m sglang_lite.sim {run,compare,fit}`: the PD cluster simulator's command line.

    python -m sglang_lite.sim compare --policies round_robin,tokens,requests,least_requests \
        --concurrency 192,256,384,512 --out sim_out
    python -m sglang_lite.sim run --policy least_requests --concurrency 256 --duration 600
    python -m sglang_lite.sim fit balance.csv --out fitted.json

A bad argument ends with one line saying what is wrong (exit status 2, as argparse does); a run that fails ends
with one line naming the error (exit status 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

from sglang_lite.sim.sim_config import (
    SimConfig,
    load_cluster_file,
    load_trace_config,
    save_cluster_file,
)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (what is wrong, where to look) instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def policy_label(label: str) -> str:
    """A compare label the simulator can run: a plain router policy, a power-of-two load metric or a candidate."""
    from sglang_lite.router.policies import LOAD_METRICS
    from sglang_lite.sim.router_sim import EXTRA_POLICIES, PLAIN_POLICIES

    known = (*PLAIN_POLICIES, *LOAD_METRICS, *EXTRA_POLICIES)
    if label in known:
        return label
    hint = " (power_of_two is named by its load metric here)" if label == "power_of_two" else ""
    raise argparse.ArgumentTypeError(
        f"unknown policy {label!r}{hint}; choose from {', '.join(known)}"
    )


def policy_list(text: str) -> list[str]:
    return [policy_label(label.strip()) for label in _items(text)]


def concurrency_list(text: str) -> list[int]:
    return [positive_int(c) for c in _items(text)]


def _items(text: str) -> list[str]:
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError("give a comma-separated list, e.g. 192,256")
    return items


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be above 0")
    return value


def existing_file(text: str) -> str:
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text


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
        "--cluster-file",
        type=existing_file,
        default=None,
        help="cost model + cluster JSON (default: the packaged one)",
    )
    p.add_argument(
        "--duration", type=positive_float, default=3600.0, help="simulated seconds per run"
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds excluded from metrics (default min(300, duration/6))",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--poll-interval", dest="poll_interval_s", type=positive_float, default=None)
    p.add_argument("--dp-size", dest="decode_dp_size", type=positive_int, default=None)
    p.add_argument("--num-decode", type=positive_int, default=None)
    p.add_argument("--num-prefill", type=positive_int, default=None)
    p.add_argument(
        "--prefill-policy",
        type=policy_label,
        default=SimConfig.prefill_policy,
        help="how the router picks a prefill server (a compare label, as --policies)",
    )
    p.add_argument("--out", default=None, help="folder for plots and CSV")


def cmd_compare(args: argparse.Namespace) -> None:
    from sglang_lite.sim.compare import format_table, plot_grid, plot_ranks, run_grid

    policies, concs = args.policies, args.concurrency
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
    parser = OneLineParser(
        prog="python -m sglang_lite.sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    compare = sub.add_parser("compare", help="policies x concurrencies table")
    add_common(compare)
    compare.add_argument(
        "--policies",
        type=policy_list,
        default="round_robin,tokens,requests,least_requests",
        help="comma-separated: round_robin, random, a power-of-two load metric (tokens, requests, "
        "least_requests) or a simulator candidate (remaining, pending, ...)",
    )
    compare.add_argument("--concurrency", type=concurrency_list, default="192,256,384,512")
    compare.add_argument("--processes", type=positive_int, default=2)
    compare.set_defaults(func=cmd_compare)
    run = sub.add_parser("run", help="one simulation")
    add_common(run)
    run.add_argument("--policy", type=policy_label, default="least_requests")
    run.add_argument("--concurrency", type=positive_int, default=256)
    run.set_defaults(func=cmd_run)
    fit = sub.add_parser("fit", help="fit the decode cost model to a balance sampler CSV")
    fit.add_argument("csv", type=existing_file)
    fit.add_argument("--cluster-file", type=existing_file, default=None)
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
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "fit" and args.warmup is not None and not 0 <= args.warmup < args.duration:
        parser.error(
            f"{args.command}: --warmup {args.warmup:g} must be at least 0 and below --duration"
        )
    try:
        args.func(args)
    except Exception as exc:  # noqa: BLE001 - one line for the user, not a traceback
        sys.exit(f"{parser.prog} {args.command}: error: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
