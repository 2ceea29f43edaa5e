"""Benchmark and GPU-check cases for block FP8 (the W8A8 block GEMM and the FP8 fused MoE), at Qwen3.5 sizes.

On the GPU the weights are in the device's FP8 format (e4m3fnuz on MI300, e4m3fn elsewhere). The checks compare
the Triton kernels with the PyTorch references, and the references with bf16 arithmetic on the dequantized
weights; one check replays both kernels from a captured CUDA graph.
"""

from __future__ import annotations

from functools import partial

import torch

from sglang_lite.kernels import fp8_dtype, moe, w8a8_block_fp8_matmul
from sglang_lite.kernels.moe import naive as moe_naive
from sglang_lite.kernels.quant import dequantize_blocks, naive, quantize_blocks

from ._compare import check_row
from ._timing import time_ms

BLOCK = (128, 128)
# the kernels against the references: same FP8 inputs, fp32 sums in another order (bf16 output rounding; in the
# MoE a bf16 activation that rounds the other way may also flip its FP8 rounding); the references against bf16 on
# the dequantized weights: plus the activations' FP8 rounding
KERNEL_TOL, MOE_KERNEL_TOL, FP8_TOL = 2e-2, 5e-2, 8e-2


def _fp8_weight(shape: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # fp8_dtype("cuda"): the format of the GPU this runs on (or, compiling ahead of time, of the target)
    w, scale = quantize_blocks(torch.randn(*shape) * shape[-1] ** -0.5, BLOCK, fp8_dtype("cuda"))
    return w.to(device), scale.to(device)


def _moe_inputs(
    tokens: int, hidden: int, inter: int, experts: int, top_k: int, device: torch.device
):
    # + a fused shared expert
    w13, w13_scale = _fp8_weight((experts + 1, 2 * inter, hidden), device)
    w2, w2_scale = _fp8_weight((experts + 1, hidden, inter), device)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    weights, ids = moe_naive.topk_softmax(torch.randn(tokens, experts, device=device), top_k)
    weights = torch.cat([weights, torch.rand(tokens, 1, device=device)], 1)
    ids = torch.cat([ids, torch.full_like(ids[:, :1], experts)], 1)
    return x, w13, w2, weights, ids, dict(w13_scale=w13_scale, w2_scale=w2_scale, block=BLOCK)


def check(device: torch.device) -> list[dict]:
    rows = []
    for tokens, out_features, in_features in ((1, 4096, 2048), (65, 2000, 2048), (300, 2048, 1000)):
        w, scale = _fp8_weight((out_features, in_features), device)
        x = torch.randn(tokens, in_features, device=device, dtype=torch.bfloat16)
        want = naive.w8a8_block_fp8_matmul(x, w, scale, BLOCK)
        shape = f"M={tokens} N={out_features} K={in_features}"
        rows.append(
            check_row(
                f"w8a8_block_fp8_matmul {shape}",
                w8a8_block_fp8_matmul(x, w, scale, BLOCK, backend="triton"),
                want,
                KERNEL_TOL,
            )
        )
        rows.append(
            check_row(
                f"block fp8 reference vs bf16 dequantized {shape}",
                want,
                x @ dequantize_blocks(w, scale, BLOCK, torch.bfloat16).t(),
                FP8_TOL,
            )
        )
    for tokens in (16, 100):
        x, w13, w2, weights, ids, scales = _moe_inputs(tokens, 2048, 512, 16, 8, device)
        want = moe.fused_moe(x, w13, w2, weights, ids, backend="torch", **scales)
        rows.append(
            check_row(
                f"fused_moe fp8 T={tokens} E=16 top8+shared",
                moe.fused_moe(x, w13, w2, weights, ids, backend="triton", **scales),
                want,
                MOE_KERNEL_TOL,
            )
        )
        plain = moe_naive.fused_moe(
            x,
            dequantize_blocks(w13, scales["w13_scale"], BLOCK, torch.bfloat16),
            dequantize_blocks(w2, scales["w2_scale"], BLOCK, torch.bfloat16),
            weights,
            ids,
        )
        rows.append(
            check_row(
                f"fused_moe fp8 reference vs bf16 dequantized T={tokens}", want, plain, FP8_TOL
            )
        )
    if device.type == "cuda":
        rows.append(_graph_check(device))
    return rows


def _graph_check(device: torch.device) -> dict:
    """Both kernels captured in one CUDA graph and replayed on new inputs give the eager result."""
    w, scale = _fp8_weight((2048, 2048), device)
    x, w13, w2, weights, ids, scales = _moe_inputs(16, 2048, 512, 16, 8, device)

    def step() -> torch.Tensor:
        hidden = w8a8_block_fp8_matmul(x, w, scale, BLOCK, backend="triton")
        return moe.fused_moe(hidden, w13, w2, weights, ids, backend="triton", **scales)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    return check_row("block fp8 linear + fused_moe replayed from a CUDA graph", out, step(), 1e-6)


def bench(device: torch.device, quick: bool) -> list[dict]:
    if device.type != "cuda":
        return []  # the CPU dequantizes FP8 checkpoints at load: see benchmarks/bench_fp8.py
    rows = []
    for tokens in (16, 1024) if quick else (1, 16, 256, 1024, 8192):
        w, scale = _fp8_weight((4096, 2048), device)
        dense = dequantize_blocks(w, scale, BLOCK, torch.bfloat16)
        x = torch.randn(tokens, 2048, device=device, dtype=torch.bfloat16)
        rows.append(
            {
                "kernel": "w8a8_block_fp8_matmul (incl. activation quant)",
                "shape": f"M={tokens} N=4096 K=2048",
                "ours_ms": time_ms(
                    partial(w8a8_block_fp8_matmul, x, w, scale, BLOCK), device, iters=20
                ),
                "ref_name": "torch bf16 matmul",
                "ref_ms": time_ms(partial(torch.matmul, x, dense.t()), device, iters=20),
                "flops": 2 * tokens * 4096 * 2048,
            }
        )
        x, w13, w2, weights, ids, scales = _moe_inputs(tokens, 2048, 512, 256, 8, device)
        w13_bf16 = dequantize_blocks(w13, scales["w13_scale"], BLOCK, torch.bfloat16)
        w2_bf16 = dequantize_blocks(w2, scales["w2_scale"], BLOCK, torch.bfloat16)
        rows.append(
            {
                "kernel": "fused_moe fp8 (shared expert fused)",
                "shape": f"T={tokens} H=2048 I=512 E=256 top8+1",
                "ours_ms": time_ms(
                    partial(moe.fused_moe, x, w13, w2, weights, ids, **scales), device, iters=20
                ),
                "ref_name": "fused_moe bf16 (ours)",
                "ref_ms": time_ms(
                    partial(moe.fused_moe, x, w13_bf16, w2_bf16, weights, ids), device, iters=20
                ),
                "flops": 2 * 3 * tokens * 9 * 2048 * 512,
            }
        )
    return rows
