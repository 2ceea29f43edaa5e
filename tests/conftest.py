"""Set for the whole session, before any test module imports a kernel: Triton kernels run in its interpreter on the
CPU (``triton.jit`` decides between interpreted and compiled kernels when a kernel module is imported, and test
folders other than tests/kernels import the kernels too). On the CPU the library itself runs the PyTorch
references unless Triton is asked for, so only the kernel tests, which ask, see the difference."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"


def pytest_sessionstart(session) -> None:
    """Build the fused C++ CPU kernels once, before any test starts a server process: those load the build, and
    tests of the kernels fail loudly if it cannot be made (tests/kernels/test_cpu_native.py)."""
    from sglang_lite.kernels import cpu

    cpu.available()
