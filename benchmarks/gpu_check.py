"""On a GPU: run every kernel case's correctness check, then the timing table (under 5 minutes).

Prints PASS/FAIL per check and exits non-zero when any check fails. On a machine without a GPU it says so and exits 0.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import run_table  # noqa: E402
from kernel_cases import load_cases  # noqa: E402


def run_checks(device: torch.device) -> bool:
    all_ok = True
    for module in load_cases():
        family = module.__name__.rsplit(".", 1)[-1]
        try:
            results = module.check(device)
        except Exception as exc:  # a crash in one family must not hide the others' results
            print(f"FAIL {family}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-4)}")
            all_ok = False
            continue
        for r in results:
            print(
                f"{'PASS' if r['ok'] else 'FAIL'} {family}: {r['name']} (max rel err {r['max_rel_err']:.2e})"
            )
            all_ok &= bool(r["ok"])
    return all_ok


def main() -> int:
    if not torch.cuda.is_available():
        print("no GPU found: nothing to check (run the CPU tests with pytest instead)")
        return 0
    device = torch.device("cuda")
    start = time.perf_counter()
    ok = run_checks(device)
    torch.cuda.synchronize()
    print(f"checks: {'all passed' if ok else 'FAILURES'} in {time.perf_counter() - start:.0f} s")
    print(run_table(device, quick=True))
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
