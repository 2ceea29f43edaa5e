"""Shared helpers for kernel tests: NaN-poisoned outputs and a relative-error check that fails on NaN."""

from __future__ import annotations

import torch

# Relative error bounds by dtype: the Triton kernels accumulate in fp32 but read and write the input dtype.
REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e|, computed in fp64; NaN anywhere in ``actual`` gives NaN."""
    a, e = actual.double(), expected.double()
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-12)).item() if e.numel() else 0.0


def assert_rel_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, name: str = "output"
) -> None:
    assert actual.shape == expected.shape, (
        f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    err = rel_err(actual, expected)
    tol = REL_TOL[dtype]
    assert err <= tol, (
        f"{name}: relative error {err} > {tol} ({dtype})"
    )  # NaN fails this comparison too


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a freshly allocated output with NaN so that any element a kernel forgets to write fails the test."""
    return t.fill_(float("nan"))
