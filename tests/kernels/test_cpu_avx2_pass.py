"""The AVX2 pass: on an AVX-512 host the suite's native pass runs the AVX-512 kernels only, so the tests of the C++
CPU kernels and one engine parity test run again in a child pytest under ``SGLANG_CPU_ISA=avx2`` (PyTorch's own
kernels put on AVX2 as well), as an AVX2-only CPU runs them: 256-bit vectors, 6x16 register tiles, bf16 and FP8
widened by vector conversions, MXFP4 by 8-entry vpermps lookups. The AVX2 build is cached beside the native one
(the child shares the cache), so only the first run on a machine pays its compile."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_lite.kernels.cpu import build

REPO = Path(__file__).resolve().parents[2]
# Every test that runs the C++ kernels (test_interleaved_state_pools only on its native backend; the kernels'
# Triton tests are left out), the check that the child loaded the AVX2 build, and greedy tokens against
# transformers through the Engine.
AVX2_TESTS = [
    "tests/kernels/test_cpu_isa.py",
    "tests/kernels/test_cpu_native.py",
    "tests/kernels/test_cpu_weights.py",
    "tests/kernels/test_cpu_mxfp4.py",
    "tests/kernels/test_cpu_mxfp4_blocks.py",
    "tests/kernels/test_greedy_head.py",
    "tests/kernels/test_batch_invariant.py",
    "tests/kernels/test_interleaved_state_pools.py",
    "tests/models/test_decode_blocks.py",
    "tests/models/test_verify_states.py",
    "tests/models/test_cpu_bf16_weights.py",
    "tests/speculative/test_spec_blocks.py",
    "tests/engine/test_sampling.py::test_cpu_argmax_equals_torch_argmax",
    "tests/engine/test_engine_parity.py::test_engine_concurrent_requests_match_transformers[moe]",
]
# The interleaved pools' and argmax's other backends left out. -k matches whole ids: a test added above whose id
# has either word, but not "native", would be left out too.
SELECTION = "native or not (triton or torch)"
# A hung child fails the test instead of the CI job (the pass takes a small fraction of this).
TIMEOUT_S = 900
OUTPUT_TAIL = 6000


def _cpu_flags() -> set[str]:
    return set(build._cpu_features().partition(":")[2].split())


def _skip_reason() -> str | None:
    if os.environ.get("SGLANG_CPU_ISA"):
        return f"this run is already forced to SGLANG_CPU_ISA={os.environ['SGLANG_CPU_ISA']}"
    flags = _cpu_flags()
    if "avx512f" not in flags:
        return "this CPU has no AVX-512: the native pass is the AVX2 pass"
    lacking = [f for f in build.ISA_TARGETS["avx2"][1] if f not in flags]
    if lacking:
        return f"this CPU cannot run the AVX2 build (x86-64-v3): it lacks {', '.join(lacking)}"
    return None


def _avx2_environment() -> dict[str, str]:
    return {**os.environ, "SGLANG_CPU_ISA": "avx2", **build.torch_isa_env("avx2")}


def test_the_cpu_kernel_tests_pass_on_avx2():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", SELECTION]
    try:
        done = subprocess.run(
            command + AVX2_TESTS,
            cwd=REPO,
            env=_avx2_environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout or ""
        output = output.decode(errors="replace") if isinstance(output, bytes) else output
        pytest.fail(
            f"the AVX2 pass ran over {TIMEOUT_S} s; its output ends:\n{output[-OUTPUT_TAIL:]}"
        )
    assert done.returncode == 0, (
        f"the AVX2 pass failed (exit {done.returncode}); its output ends:\n{done.stdout[-OUTPUT_TAIL:]}"
    )
