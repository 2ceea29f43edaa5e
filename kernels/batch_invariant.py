"""Batch invariance, the kernels' half of ``--enable-deterministic-inference``: every kernel computes each row of its
result (a token's) in an order that does not depend on how many rows it has or what they hold, so a request's
values are the same bits alone, in any batch, in any chunk of its prompt and in a speculative verify step.

One switch per process, as SGLang's batch-invariant mode (the engine's rank process sets it from the server
argument; tests use ``batch_invariant_mode``). What it changes:

- C++ products (``kernels/cpu``): already add each output's k terms one at a time in k order whatever their tile;
  with the switch no K split over the threads, no MKL, and bf16 weights take one path at every row count. Float32
  weights then run there at every size (MKL's blocking depends on the shapes).
- Attention on the CPU: each new token of an extend runs as a decode query over its own prefix
  (``kernels/attention``), the arithmetic of a decode step whatever the chunk or batch.
- Triton: no atomics, fixed splits (``kernels/*/triton_*.py`` read ``enabled()``).
- Sampling (``sampling/sampler.py``): a seeded request draws from a generator keyed by its seed and position.

The Gated DeltaNet's CPU kernels run the recurrence token by token (prefill and decode alike), and norms, routing
and the conv compute per row already: they need no switch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_on = False


def enabled() -> bool:
    """Whether this process runs batch invariant (asked per kernel call: a plain read)."""
    return _on


def set_enabled(on: bool) -> None:
    """Turn batch invariance on or off for this process (the C++ kernels too, if loaded; ``kernels/cpu`` applies
    it when it loads them later)."""
    global _on
    _on = bool(on)
    from . import cpu

    if cpu.build.loaded():
        cpu.set_batch_invariant(_on)


@contextlib.contextmanager
def batch_invariant_mode(on: bool = True) -> Iterator[None]:
    """Batch invariance on (or off) inside the block, restored after it."""
    before = _on
    set_enabled(on)
    try:
        yield
    finally:
        set_enabled(before)
