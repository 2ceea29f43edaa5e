"""Fused float32 CPU kernels in C++: the decode step's ops, the linear layers and the fused MoE
(``csrc/decode_ops.cpp``; linear and MoE serve prefill too), and the Gated DeltaNet prefill, the gated delta rule
and the packed causal conv1d (``csrc/prefill_ops.cpp``).

On the CPU a forward is made of small ops, and dispatching each one (Python, then ATen) costs more than its
arithmetic: a GDN layer of the references is a hundred-odd dispatched ops. Each kernel here computes what one
reference in ``kernels/<family>/naive.py`` computes, in one call and one pass over its operands. They are the
CPU's fast path for float32 data (``dispatch.use_native``); the references stay the definition and the path for
other dtypes.

The sources are compiled with torch's ``cpp_extension`` on first use (g++ and ninja must be on the machine; the
build takes a while and says so once, at WARNING) into ``SGLANG_CPU_KERNEL_CACHE`` (default
``~/.cache/sglang_lite/cpu_kernels``), one build folder per set of sources, flags, torch installation and CPU
(``-march=native``), named by their hash, and loaded from there afterwards. The sources are copied into that folder
and compiled from there: the build's files then name only the cache's paths, so two checkouts of the same code
share one build instead of rebuilding each other's. When it cannot be built the CPU runs the references and says
why once. ``SGLANG_KERNEL_BACKEND=torch`` turns these kernels off for a run.
"""

from __future__ import annotations

import os

import torch

from sglang_lite import envs

from .. import batch_invariant
from .blocks import (  # noqa: F401 - the decode blocks, one call each
    MXFP4,
    AttentionHeads,
    DecodeLayers,
    GdnHeads,
    Norm,
    Weight,
    attention_decode_block,
    gdn_decode_block,
    mlp_decode_block,
    moe_decode_block,
    mtp_input_block,
)
from .build import (  # noqa: F401 - the package's build interface
    _build_and_load,
    available,
    build_directory,
    cpu_flags,
    describe_isa,
    enabled,
    isa,
    loaded,
    prepare,
    require,
    stage_sources,
    torch_isa_env,
)


def _ops():
    return torch.ops.sglang_lite_cpu


def _float(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def gemma_rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """As ``norms.naive.gemma_rmsnorm``: float32 x (and residual) of any shape, normalised over the last dim."""
    y, total = _ops().gemma_rmsnorm(x, _float(weight), eps, residual)  # shaped like x
    return y if residual is None else (y, total)


def fused_qk_gemma_rmsnorm(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``norms.naive.fused_qk_gemma_rmsnorm``: every head_dim-sized row of q and of k."""
    q_rows, k_rows = q.reshape(-1, 1, head_dim), k.reshape(-1, 1, head_dim)
    return gemma_rmsnorm(q_rows, q_weight, eps).view(q.shape), gemma_rmsnorm(
        k_rows, k_weight, eps
    ).view(k.shape)


def gated_rmsnorm(
    o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """As ``norms.naive.gated_rmsnorm``."""
    return _ops().gated_rmsnorm(o, _float(z), _float(weight), eps)  # shaped like o


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """As ``conv1d.naive.causal_conv1d_update``: x [B, D]; the float32 pool's slots are shifted in place. Batch
    invariant: through the prefill kernel, one token a request, so that a decode token's arithmetic is a prompt
    token's (a retracted request's prompt and output, prefilled again, give the same bits)."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    if batch_invariant.enabled():
        one_each = _one_token_each(x)
        return causal_conv1d_fn(x, weight, conv_states, state_indices, one_each, activation)
    return _ops().causal_conv1d_update(
        _last_dim_contiguous(x),
        _float(weight).contiguous(),
        conv_states,
        state_indices,
        activation is not None,
    )


def _one_token_each(rows: torch.Tensor) -> torch.Tensor:
    """cu_seqlens of a decode batch as a prefill: one token per request."""
    return torch.arange(rows.shape[0] + 1, dtype=torch.int64, device=rows.device)


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """As ``conv1d.naive.causal_conv1d_fn``: x [T, D] packed requests; the float32 pool's slots are replaced by
    each request's last K-1 inputs."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    return _ops().causal_conv1d_prefill(
        _last_dim_contiguous(x),
        _float(weight).contiguous(),
        conv_states,
        state_indices,
        cu_seqlens,
        activation is not None,
    )


def fused_gdn_gating(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``gated_delta_rule.naive.fused_gdn_gating``: a, b [T, H]."""
    return _ops().gdn_gating(
        _float(A_log), _last_dim_contiguous(a), _float(dt_bias), _last_dim_contiguous(_float(b))
    )


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """As ``gated_delta_rule.naive.chunk_gated_delta_rule`` (whatever its chunk size: this runs the recurrence token
    by token); the float32 pool is updated in place."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    q = _last_dim_contiguous(q)
    k = _last_dim_contiguous(k)
    v = _last_dim_contiguous(v)
    g, beta = _last_dim_contiguous(_float(g)), _last_dim_contiguous(_float(beta))
    return _ops().gated_delta_rule_prefill(
        q, k, v, g, beta, ssm_states, state_indices, cu_seqlens, scale, use_qk_l2norm
    )


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """As ``gated_delta_rule.naive.fused_recurrent_gated_delta_rule``; the float32 pool is updated in place. Batch
    invariant: through the prefill kernel, one token a request (as ``causal_conv1d_update``)."""
    if batch_invariant.enabled():
        one_each = _one_token_each(q)
        return chunk_gated_delta_rule(
            q, k, v, g, beta, ssm_states, state_indices, one_each, scale, use_qk_l2norm
        )
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    q = _last_dim_contiguous(q)
    k = _last_dim_contiguous(k)
    v = _last_dim_contiguous(v)
    g, beta = _last_dim_contiguous(_float(g)), _last_dim_contiguous(_float(beta))
    return _ops().gated_delta_rule_decode(
        q, k, v, g, beta, ssm_states, state_indices, scale, use_qk_l2norm
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    page_size: int = 1,
) -> torch.Tensor:
    """As ``attention.naive.decode_attention`` over a float32 pool."""
    return _ops().decode_attention(
        _last_dim_contiguous(q),
        k_cache,
        v_cache,
        page_table,
        req_pool_indices,
        seq_lens,
        scale,
        page_size,
    )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    scale: float,
    page_size: int = 1,
) -> torch.Tensor:
    """As ``attention.naive.extend_attention`` over a float32 pool (the attention prefill block's kernel)."""
    return _ops().extend_attention(
        _last_dim_contiguous(q),
        k_cache,
        v_cache,
        page_table,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        scale,
        page_size,
    )


# Where the fused linear beats MKL on float32 weights (the figures: docs/performance.md). An [in, out] weight: from 1
# to a few hundred rows at every width from 16 columns on; at thousands of rows the two are even, and on a weight of
# fewer than 16 columns MKL wins (it parallelises over the rows, the kernel over the columns). An [out, in] weight (a
# tied LM head, which is the embedding): up to 16 rows. bf16 and FP8 weights, which MKL does not take beside float32
# activations, run here at every size.
LINEAR_MAX_ROWS = 256
LINEAR_MAX_ROWS_OUT_IN = 16
LINEAR_MIN_COLUMNS = 16
WIDENED_WEIGHTS = (torch.bfloat16, torch.float8_e4m3fn)
FP8_BLOCK_COLUMNS = 128  # FP8 scale blocks must span a multiple of this many output columns


# SGLANG_CPU_BF16_DOT as the kernels take it (gemm.h)
BF16_DOT_MODES = {"widen": 0, "auto": 1, "dot": 2}


def bf16_dot() -> int:
    """How bf16 weights meet the rows in the kernels (``SGLANG_CPU_BF16_DOT``): 0 widen, 1 auto, 2 vdpbf16ps at
    every row count (the kernels widen on CPUs without the instruction). Asked for every call: the unset variable
    is the quick case."""
    if envs.SGLANG_CPU_BF16_DOT.name not in os.environ:
        return BF16_DOT_MODES["auto"]
    return BF16_DOT_MODES[envs.SGLANG_CPU_BF16_DOT.get()]


def has_dpbf16() -> bool:
    """Whether the kernels were built with AVX512-BF16's vdpbf16ps (the CPU has it)."""
    return bool(_ops().has_dpbf16())


def bf16_dot_speed() -> float:
    """vdpbf16ps's products per second over the float32 FMA's on this CPU, measured once per process (0 without
    the instruction): auto takes vdpbf16ps for more than 8 rows where this is 1 or more."""
    return float(_ops().bf16_dot_speed())


def bf16_dot_takes(rows: int, mode: int | None = None) -> bool:
    """Whether a bf16 product of ``rows`` rows takes vdpbf16ps (its activations rounded to bf16) under ``mode``
    (default: the environment's)."""
    return bool(_ops().bf16_dot_for(bf16_dot() if mode is None else mode, rows))


def set_batch_invariant(on: bool) -> None:
    """The C++ side of ``kernels.batch_invariant`` (which calls this): gemm.h's switch."""
    _ops().set_batch_invariant(on)


def takes_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> bool:
    """The shapes and layouts ``linear`` serves: float32 weights [N, K] of N >= 16 stored [in, out] and up to
    LINEAR_MAX_ROWS rows, or stored [out, in] (contiguous) and up to LINEAR_MAX_ROWS_OUT_IN rows (batch invariant:
    every float32 weight contiguous along one dimension, at any size); bf16 weights in
    either layout at any row count; FP8 weights (with ``scale`` for ``block``) stored [in, out] in scale blocks of a
    multiple of 128 output columns."""
    if weight.dim() != 2 or not weight.is_cpu:
        return False
    if weight.dtype == torch.float32 and batch_invariant.enabled():
        # MKL's blocking follows the shapes: every size here
        return weight.stride(0) == 1 or weight.stride(1) == 1
    rows = x.shape[0] if x.dim() == 2 else x.numel() // max(x.shape[-1], 1)
    if weight.dtype in WIDENED_WEIGHTS:
        if scale is not None or weight.dtype != torch.bfloat16:
            input_major = weight.stride(0) == 1 and weight.shape[0] > 1
            return input_major and block is not None and block[0] % FP8_BLOCK_COLUMNS == 0
        return weight.stride(0) == 1 or weight.stride(1) == 1
    if weight.dtype != torch.float32 or weight.shape[0] < LINEAR_MIN_COLUMNS:
        return False
    if weight.stride(0) == 1:
        return 0 < rows <= LINEAR_MAX_ROWS
    return weight.stride(1) == 1 and 0 < rows <= LINEAR_MAX_ROWS_OUT_IN


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``x @ weight^T`` for float32 x [M, K] and weight [N, K] as ``takes_linear`` accepts them (an FP8 weight
    times its block scales)."""
    return _ops().linear_rows(_last_dim_contiguous(x), weight, scale, block or [], bf16_dot())


def bf16_planes_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``linear(x, weight)`` for a bf16 weight stored [in, out], with one row's products reading the weight's 12-bit
    planes (``csrc/bf16_planes.h``: the same values, bitwise), built for the call; through the weight alone where
    they cannot be built (``bf16_planes_bytes`` -1). The decode blocks keep them (``DecodeLayers``)."""
    return _ops().bf16_planes_linear(_last_dim_contiguous(_float(x)), weight, bf16_dot())


def bf16_planes_bytes(weight: torch.Tensor) -> int:
    """The bytes of a bf16 [in, out] weight's 12-bit planes, or -1 where they are not built for it (fewer than 64
    output columns, not bf16 stored [in, out], or high bytes too varied for the rows' tables)."""
    return _ops().bf16_planes_bytes(weight)


def greedy_head_argmax(
    x: torch.Tensor, weight: torch.Tensor, mode: int | None = None
) -> torch.Tensor:
    """Each row's argmax of ``linear(x, weight)`` (float32 or bf16 weight [V, K], unscaled) through a
    ``csrc/greedy_head.h`` screen built for the call, runs of up to 8 rows at a time (as ``linear`` of such a run
    computes them): int64 [B], -1 where the screen leaves a row undecided (the whole head's logits then decide).
    ``mode``: how bf16 weights meet the rows (``bf16_dot``'s values)."""
    return _ops().greedy_head_argmax(
        _last_dim_contiguous(_float(x)), weight, bf16_dot() if mode is None else mode
    )


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of float32 [B, V] logits (int64 [B]; NaN counts as the maximum, as torch's)."""
    return _ops().argmax_rows(_last_dim_contiguous(logits))


def moe_route(
    router_logits: torch.Tensor,
    shared_logits: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    shared_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``moe.naive.moe_route``: float32 router logits [T, E] (and shared-expert logits [T, 1])."""
    return _ops().moe_route(
        _last_dim_contiguous(router_logits), shared_logits, top_k, renormalize, shared_id
    )


# The fused MoE runs a prefill's tokens in chunks: its buffers (every (token, expert) pair's row) stay small enough
# to be reused from the heap instead of fresh, page-faulting mappings, and each chunk's rows stay in cache. Chunked,
# it beats the reference's padded batched GEMMs at every prefill size measured (docs/performance.md).
MOE_CHUNK_TOKENS = 1024


def takes_moe(w13: torch.Tensor, block: tuple[int, int] | None = None) -> bool:
    """Experts ``fused_moe`` serves: float32 or bf16 in either layout; FP8 stored [in, out] in scale blocks of a
    multiple of 128 output columns."""
    if w13.dtype in (torch.float32, torch.bfloat16):
        return True
    input_major = w13.dtype == torch.float8_e4m3fn and w13.stride(1) == 1
    return input_major and block is not None and block[0] % FP8_BLOCK_COLUMNS == 0


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """As ``moe.naive.fused_moe`` for float32 x and experts as ``takes_moe`` accepts them; FP8 experts are
    multiplied by their block scales in registers (x stays float32)."""
    x = _last_dim_contiguous(x)
    topk_weights = _float(topk_weights)
    topk_ids = topk_ids.contiguous()
    extra = (w13_scale, w2_scale, block or [], bf16_dot())
    if x.shape[0] <= MOE_CHUNK_TOKENS:
        return _ops().fused_moe(x, w13, w2, topk_weights, topk_ids, *extra)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for start in range(0, x.shape[0], MOE_CHUNK_TOKENS):
        rows = slice(start, start + MOE_CHUNK_TOKENS)
        out[rows] = _ops().fused_moe(x[rows], w13, w2, topk_weights[rows], topk_ids[rows], *extra)
    return out


# ---- the decode blocks' own elementwise steps, for the modules under batch invariance (layer_ops.cpp) -------------


def rotary_rows(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rotary_dim: int
) -> torch.Tensor:
    """x [T, heads, hd] rotated (partial NeoX) as the attention block rotates it: a contiguous copy."""
    return _ops().rotary_rows(_last_dim_contiguous(x), positions, cos_sin_cache, rotary_dim)


def sigmoid_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """out * sigmoid(gate), both [T, heads, hd], as the attention block gates its output."""
    return _ops().sigmoid_gate_rows(_last_dim_contiguous(out), _last_dim_contiguous(gate))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of rows [gate | up] [T, 2I]: [T, I], as the MLP blocks compute it."""
    return _ops().silu_and_mul_rows(_last_dim_contiguous(gate_up))


def add_gated(routed: torch.Tensor, shared: torch.Tensor, logit: torch.Tensor) -> torch.Tensor:
    """routed + sigmoid(logit) * shared ([T, H], logit [T, 1]), as the MoE block adds a separate shared expert."""
    return _ops().add_gated_rows(routed, shared, logit)


# ---- MXFP4 weights (kernels/quant/mxfp4.py's layout, read as they are: csrc/mxfp4.h) ---------------------------


def _packed_rows(t: torch.Tensor, dim: int) -> bool:
    return t.dim() == dim and t.is_cpu and t.dtype == torch.uint8 and t.stride(-1) == 1


def takes_linear_mxfp4(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear_mxfp4`` serves these operands: float32 x and a uint8 weight [N, K / 2] whose rows are
    contiguous (any other x runs the reference)."""
    return x.dtype == torch.float32 and _packed_rows(weight, 2)


def linear_mxfp4(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ W^T`` for float32 x [M, K] and W the MXFP4 weight [N, K / 2] with its e8m0 scales [N, ceil(K / 32)],
    widened in registers (float32 [M, N]); each row's bits are the same at any M."""
    return _ops().linear_rows(_last_dim_contiguous(x), weight, scale, [], 0)


def takes_moe_mxfp4(x: torch.Tensor, w13: torch.Tensor) -> bool:
    """Whether ``fused_moe_mxfp4`` serves these experts: float32 x, uint8 w13 [E, 2I, H / 2] with contiguous rows."""
    return x.dtype == torch.float32 and _packed_rows(w13, 3)


def fused_moe_mxfp4(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
) -> torch.Tensor:
    """As ``moe.naive.fused_moe_mxfp4`` for float32 x [T, H]: MXFP4 experts w13 [E, 2I, H / 2] and w2 [E, H, I / 2]
    with their e8m0 scales, widened in registers; chunked as ``fused_moe``."""
    return fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
