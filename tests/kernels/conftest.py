"""Fixtures of the kernel tests. The kernels run in Triton's interpreter: tests/conftest.py sets TRITON_INTERPRET
before any test module imports them."""

from __future__ import annotations

import pytest
import torch

from .utils import poison_


@pytest.fixture
def nan_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every floating tensor a launcher allocates with torch.empty / empty_like starts as NaN, so an element a
    kernel forgets to write shows up as NaN in the comparison."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(t: torch.Tensor) -> torch.Tensor:
        return poison_(t) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poisoned(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poisoned(real_empty_like(*a, **kw)))
