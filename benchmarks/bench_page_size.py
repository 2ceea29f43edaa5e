"""The decode step against ``--page-size``: a scheduler on the built-in tiny model (one torch thread, as a server rank
with ``--cpu-threads-per-rank 1``) runs ``--batch`` requests of ``--input-len`` random tokens to their decode, then
``--steps`` decode steps are timed one by one (``Scheduler.step``: page allocation, the page-table reads of the
attention kernels, sampling) in CPU time of the scheduler's thread, which a busy host disturbs less than the
wall clock (one torch thread: the step's work all runs there). Each page size runs in its own process, the sizes
interleaved over ``--rounds`` so that a busy host's drift falls on all of them alike; per size the median step
of each round and their median.

``--kernel-backend torch`` times the PyTorch reference path (the CPU's path for half precision) instead of the
fused C++ kernels. ``--baseline DIR`` adds the same runs on another checkout of sglang_lite (one from before
``--page-size``: its package imported from DIR, byte-compiled files not written), interleaved with the others.

    python benchmarks/bench_page_size.py --page-sizes 1 16 64 --baseline /path/to/main
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def one_run(page_size: int, args: argparse.Namespace) -> list[float]:
    import random

    import torch

    from sglang_lite.runtime.factory import create_scheduler
    from sglang_lite.server_args import ServerArgs

    torch.set_num_threads(1)
    extra = {} if page_size == 0 else {"page_size": page_size}  # 0: a checkout without --page-size
    sched = create_scheduler(
        ServerArgs(
            skip_tokenizer_init=True,
            max_running_requests=args.batch,
            max_total_tokens=args.batch * (args.input_len + args.steps + 64),
            context_length=args.input_len + args.steps + 64,
            disable_radix_cache=True,
            **extra,
        )
    )
    rng = random.Random(0)
    params = {"max_new_tokens": args.steps + 8, "temperature": 0.0, "ignore_eos": True}
    for i in range(args.batch):
        sched.add_request(str(i), [rng.randrange(3, 4000) for _ in range(args.input_len)], params)
    while len(sched.queues.running) < args.batch:
        sched.step()
    times = []
    for _ in range(args.steps):
        start = time.thread_time()
        sched.step()
        times.append((time.thread_time() - start) * 1e3)
    return times


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kernel-backend", default=None, help="SGLANG_KERNEL_BACKEND for the runs")
    p.add_argument("--baseline", default=None, help="another checkout to time alongside")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(one_run(args.one, args)))
        return
    env = dict(os.environ)
    if args.kernel_backend:
        env["SGLANG_KERNEL_BACKEND"] = args.kernel_backend
    runs = {f"page size {size}": (size, env) for size in args.page_sizes}
    if args.baseline:
        baseline = dict(env, PYTHONPATH=args.baseline, PYTHONDONTWRITEBYTECODE="1")
        runs[f"baseline {args.baseline}"] = (0, baseline)
    medians: dict[str, list[float]] = {label: [] for label in runs}
    print(f"{os.cpu_count()} CPUs; load average {os.getloadavg()}")
    for _ in range(args.rounds):
        for label, (size, run_env) in runs.items():
            cmd = [sys.executable, __file__, "--one", str(size), *sys.argv[1:]]
            out = subprocess.run(cmd, env=run_env, capture_output=True, text=True, check=True)
            medians[label].append(statistics.median(json.loads(out.stdout.splitlines()[-1])))
    print(f"load average after {os.getloadavg()}")
    print(f"decode step (CPU ms), batch {args.batch}, context {args.input_len}+:")
    for label, values in medians.items():
        rounds = ", ".join(f"{v:.2f}" for v in values)
        print(f"  {label:<24} median {statistics.median(values):.2f} (rounds: {rounds})")


if __name__ == "__main__":
    main()
