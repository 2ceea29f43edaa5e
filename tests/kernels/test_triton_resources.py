"""Every kernel configuration of the GPU checks compiles for sm_90 and fits its shared memory (no GPU needed).

The first run on an H200 failed at launch with OutOfResources (the GDN chunk kernel asked for 243 KB of 227 KB);
benchmarks/triton_resources.py compiles ahead of time with the compilers in Triton's package and catches that
here. It runs in a fresh interpreter: this folder's conftest switches Triton to its interpreter, which compiles
nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "triton_resources.py"


def test_gpu_check_configurations_fit_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--targets", "sm90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = result.stdout + result.stderr[-3000:]
    assert result.returncode == 0, report
    assert "\n0 configuration(s) fail" in result.stdout, report
    assert result.stdout.count("sm90 ") >= 20, (
        report
    )  # the checks' launches were recorded and compiled
