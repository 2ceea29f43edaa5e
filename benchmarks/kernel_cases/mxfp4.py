"""Benchmark and GPU-check cases for MXFP4 weights (weight-only, x not quantized): the Triton linear and fused MoE
kernels against the PyTorch references at Qwen3.5 sizes, in every activation dtype the launchers take; timings
against the same Triton kernels on the bf16 weights the codes stand for.

On gfx950 (MI355X) bf16 and fp16 products go through ``tl.dot_scaled``, elsewhere through a tile dequantized in
registers (``kernels/linear/triton_linear.py``): the same checks cover whichever path the device takes.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from sglang_lite.kernels import linear, moe
from sglang_lite.kernels.moe import naive as moe_naive
from sglang_lite.kernels.quant import mxfp4

from ._compare import check_row
from ._timing import time_ms

# the kernels against the references: the same products, fp32 sums in another order and the output rounded to x's
# dtype (in the MoE also the activation between the GEMMs)
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _weight(shape: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A random MXFP4 weight [..., N, K] (packed, scales): any codes (root mean square 2.9), scales that make the
    values about K^-0.5 (a normal init's); no quantization pass, which at 257 experts costs more than the timing."""
    depth = shape[-1]
    packed = torch.randint(0, 256, (*shape[:-1], depth // 2), dtype=torch.uint8, device=device)
    exponent = mxfp4.E8M0_BIAS - round(0.5 * math.log2(depth) + 1.5)
    groups = -(-depth // mxfp4.GROUP)
    scales = torch.randint(exponent - 1, exponent + 1, (*shape[:-1], groups), device=device)
    return packed, scales.to(torch.uint8)


def _moe_experts(num_experts: int, device: torch.device) -> dict[str, torch.Tensor]:
    """MXFP4 experts at Qwen3.5-MoE's sizes (hidden 2048, intermediate 512), plus a fused shared expert."""
    w13, w13_scale = _weight((num_experts + 1, 1024, 2048), device)
    w2, w2_scale = _weight((num_experts + 1, 2048, 512), device)
    return dict(w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale)


def _routing(tokens: int, num_experts: int, device: torch.device):
    """Top-8 routing over the routed experts plus the shared expert (id ``num_experts``) with its own weight."""
    weights, ids = moe_naive.topk_softmax(torch.randn(tokens, num_experts, device=device), 8)
    weights = torch.cat([weights, torch.rand(tokens, 1, device=device)], 1)
    ids = torch.cat([ids, torch.full_like(ids[:, :1], num_experts)], 1)
    return weights, ids


def _fused_moe(x, weights, ids, experts: dict, backend: str | None = None) -> torch.Tensor:
    return moe.fused_moe(
        x, topk_weights=weights, topk_ids=ids, weight_format="mxfp4", backend=backend, **experts
    )


def check(device: torch.device) -> list[dict]:
    rows = []
    # K = 1000: a partial last group
    shapes = ((1, 4096, 2048), (65, 2000, 2048), (300, 2048, 1000))
    cases = [(s, torch.bfloat16) for s in shapes]
    cases += [((65, 2000, 2048), torch.float32), ((65, 2000, 2048), torch.float16)]
    for (tokens, out_features, in_features), dtype in cases:
        packed, scales = _weight((out_features, in_features), device)
        x = torch.randn(tokens, in_features, device=device, dtype=dtype)
        got = linear(x, packed, scales, weight_format="mxfp4", backend="triton")
        name = f"linear mxfp4 M={tokens} N={out_features} K={in_features} {dtype}"
        rows.append(check_row(name, got, mxfp4.linear(x, packed, scales), TOL[dtype]))
    experts = _moe_experts(16, device)
    moe_cases = (
        (16, torch.bfloat16),
        (100, torch.bfloat16),
        (16, torch.float32),
        (16, torch.float16),
    )
    for tokens, dtype in moe_cases:
        x = torch.randn(tokens, 2048, device=device, dtype=dtype)
        weights, ids = _routing(tokens, 16, device)
        got = _fused_moe(x, weights, ids, experts, backend="triton")
        want = _fused_moe(x, weights, ids, experts, backend="torch")
        name = f"fused_moe mxfp4 T={tokens} E=16 top8+shared {dtype}"
        rows.append(check_row(name, got, want, TOL[dtype]))
    return rows


def bench(device: torch.device, quick: bool) -> list[dict]:
    if device.type != "cuda":
        # the CPU serves MXFP4 with its C++ kernels (kernels/cpu)
        return []
    packed, scales = _weight((4096, 2048), device)
    dense = mxfp4.dequantize(packed, scales, torch.bfloat16)
    experts = _moe_experts(256, device)
    w13 = mxfp4.dequantize(experts["w13"], experts["w13_scale"], torch.bfloat16)
    w2 = mxfp4.dequantize(experts["w2"], experts["w2_scale"], torch.bfloat16)
    rows = []
    for tokens in (16, 1024) if quick else (1, 16, 256, 1024, 8192):
        x = torch.randn(tokens, 2048, device=device, dtype=torch.bfloat16)
        mxfp4_linear = partial(linear, x, packed, scales, weight_format="mxfp4")
        rows.append(
            {
                "kernel": "linear mxfp4 (Triton, weight-only)",
                "shape": f"M={tokens} N=4096 K=2048",
                "ours_ms": time_ms(mxfp4_linear, device, iters=20),
                "ref_name": "linear bf16 (ours, Triton)",
                "ref_ms": time_ms(partial(linear, x, dense, backend="triton"), device, iters=20),
                "flops": 2 * tokens * 4096 * 2048,
            }
        )
        weights, ids = _routing(tokens, 256, device)
        bf16_moe = partial(moe.fused_moe, x, w13, w2, weights, ids)
        rows.append(
            {
                "kernel": "fused_moe mxfp4 (shared expert fused)",
                "shape": f"T={tokens} H=2048 I=512 E=256 top8+1",
                "ours_ms": time_ms(partial(_fused_moe, x, weights, ids, experts), device, iters=20),
                "ref_name": "fused_moe bf16 (ours)",
                "ref_ms": time_ms(bf16_moe, device, iters=20),
                "flops": 2 * 3 * tokens * 9 * 2048 * 512,
            }
        )
    return rows
