"""Device-side helpers shared by the Triton kernels (``@triton.jit`` functions, inlined into their callers)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot_accumulate(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + a @ b`` with an fp32 ``acc``; ``PRECISION`` is the ``input_precision`` of ``dispatch.dot_precision``.

    ``UPCAST`` is for Triton's interpreter (``dispatch.triton_interpreting()``), which multiplies bf16 tiles as
    their raw uint16 bits: it widens the operands to fp32 first. Compiled kernels keep the input dtype for the
    tensor cores.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc, input_precision=PRECISION)
