"""Comparison helpers shared by the kernel cases' GPU checks: a relative error and one check row."""

from __future__ import annotations

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e| in fp64; NaN anywhere in ``actual`` gives NaN."""
    return (
        (actual.double() - expected.double()).abs().max()
        / expected.double().abs().max().clamp_min(1e-12)
    ).item()


def check_row(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> dict:
    """One check's row (``kernel_cases.__init__``): ok when the relative error is at most ``tol``."""
    err = rel_err(got, want)
    return {"name": name, "ok": bool(err <= tol), "max_rel_err": err}  # NaN fails the comparison
