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


@triton.jit
def interpreted_dot(a, b):
    """``a @ b`` in fp32 for Triton's interpreter, each output's products added in the same order whatever its row's
    place in the tile. The interpreter's ``tl.dot`` is ``numpy.matmul``, whose BLAS need not do that: on a Zen 3
    (AVX2), a row of a 64 x 32 by 32 x 64 product placed at row 0 gave other bits than at rows 6-11 of every 12, so
    a row alone (the first of its tile) and the same row in a batch of 9 differed in the last bits (2e-7) and the
    batch-invariance tests failed there; on the earlier sessions' AVX-512 hosts they passed. The batch-invariant
    products (``row_dot_accumulate``) take it, so that their tests check the kernels' own order on any host."""
    return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def row_dot_accumulate(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``dot_accumulate`` for the linear, MoE and block-FP8 products, whose rows must not depend on the rows beside
    them (batch invariance): in the interpreter ``interpreted_dot``; compiled, ``tl.dot``."""
    if UPCAST:
        return acc + interpreted_dot(a, b)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def attend_block(
    q,
    k,
    v,
    visible,
    m_i,
    l_i,
    acc,
    zero_scores,
    scale_log2,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One block of keys k and values v [N, D] into a flash attention's running state of queries q [M, D]: the row
    maxima ``m_i`` and sums ``l_i`` of exp2 scores (fp32, ``scale_log2`` = scale * log2(e)) and the output
    accumulator ``acc`` [M, D]; scores where ``visible`` [M, N] is False do not count. Returns (m_i, l_i, acc)."""
    s = dot_accumulate(q, tl.trans(k), zero_scores, UPCAST, PRECISION) * scale_log2
    s = tl.where(visible, s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = dot_accumulate(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, PRECISION)
    return m_new, l_i, acc
