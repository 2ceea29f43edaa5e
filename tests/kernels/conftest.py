"""Run the Triton kernels on the CPU through Triton's interpreter.

``triton.jit`` decides between interpreted and compiled kernels when a kernel module is imported, so the variable
is set here, before the test modules import any kernel; kernel modules that another test folder imported earlier
are re-imported so that their kernels are interpreted too.
"""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from .utils import poison_

os.environ["TRITON_INTERPRET"] = "1"

for _name, _module in list(sys.modules.items()):
    if _name.startswith("sglang_lite.kernels.") and hasattr(_module, "triton") and not hasattr(_module, "__path__"):
        importlib.reload(_module)


@pytest.fixture
def nan_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every floating tensor a launcher allocates with torch.empty / empty_like starts as NaN, so an element a
    kernel forgets to write shows up as NaN in the comparison."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(t: torch.Tensor) -> torch.Tensor:
        return poison_(t) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poisoned(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poisoned(real_empty_like(*a, **kw)))
