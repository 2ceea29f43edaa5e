"""Batch invariance, the kernels' half of ``--enable-deterministic-inference``: every kernel computes each row of its
result (a token's) in an order that does not depend on how many rows it has or what they hold, so a request's
values are the same bits alone, in any batch, in any chunk of its prompt and in a speculative verify step.

One switch per process, as SGLang's batch-invariant mode (the engine's rank process sets it from the server
argument; tests use ``batch_invariant_mode``). What it changes:

- C++ products (``kernels/cpu``): already add each output's k terms one at a time in k order whatever their tile;
  with the switch no K split over the threads, no MKL, and bf16 weights take one path at every row count. Float32
  weights then run there at every size (MKL's blocking depends on the shapes).
- Attention (C++ and Triton): each new token of an extend runs as a decode query over its own prefix
  (``kernels/attention``), the arithmetic of a decode step whatever the chunk or batch.
- The conv and the gated delta rule: a decode step runs through the prefill kernels, one token a request
  (``kernels/cpu``, and the decode blocks in C++), so that a decode token computes what a prompt token does; on
  Triton the prefill is the decode kernel's recurrence token by token, and both conv kernels add their taps in order.
- The decode blocks' elementwise steps (rotary, the output gate, silu * up, a separate shared expert's gate) run in
  the modules too (``dispatch.as_decode_blocks``).
- Triton products: linear layers through a Triton matmul whose tiles follow (N, K) alone (cuBLAS picks by the rows),
  the FP8 GEMM's row tile fixed, the MoE's per-token sum in slot order; no atomics anywhere.
- Sampling (``scheduler/sampling.key_generators``): a seeded request's generator is reseeded per draw from its seed
  and position.

Norms, routing and the GDN gating compute each row on their own already: they need no switch.
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

    if cpu.loaded():
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
