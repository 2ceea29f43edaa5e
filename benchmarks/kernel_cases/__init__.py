"""Kernel benchmark and GPU-check cases, one module per kernel family.

Each module defines
- ``check(device: torch.device) -> list[dict]``: correctness of the Triton kernels against the PyTorch references
  on that device; each dict has ``name`` (str), ``ok`` (bool) and ``max_rel_err`` (float).
- ``bench(device: torch.device, quick: bool) -> list[dict]``: timing rows; each dict has ``kernel``, ``shape``,
  ``ours_ms``, ``ref_name``, ``ref_ms`` and optionally ``bytes`` (bytes moved by our kernel) or ``flops``, from
  which the drivers (``bench_kernels.py``, ``gpu_check.py``) derive bandwidth and TFLOP/s shares.
"""

import importlib
import pkgutil

CASE_MODULES = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def load_cases():
    return [importlib.import_module(f"{__name__}.{name}") for name in CASE_MODULES]
