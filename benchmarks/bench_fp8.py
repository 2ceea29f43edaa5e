"""CPU: block-FP8 weights dequantized once at load against dequantized per GEMM (what keeping them FP8 costs).

On the CPU the loader dequantizes an FP8 checkpoint into the compute dtype; this measures why. Per projection
(N x K, 128x128 blocks) and batch size: a dense GEMM on the dequantized weight (the chosen path), and the block-FP8
reference GEMM (activations quantized per token group, the weight dequantized every call), plus the one-off cost
of dequantizing the weight at load.

    python benchmarks/bench_fp8.py [--threads 1] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_cases._timing import time_ms  # noqa: E402

from sglang_lite.kernels.quant import dequantize_blocks, naive, quantize_blocks  # noqa: E402

BLOCK = (128, 128)
# (N, K): attention / GDN projections, an expert's down_proj
SHAPES = [
    (2048, 2048),
    (4096, 2048),
    (2048, 512),
]
TOKENS = [1, 16, 256]
CPU = torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"{args.threads} thread(s), {args.dtype}; ms per call (median)\n")
    print(
        f"{'N x K':>11} {'tokens':>6} {'dequantized at load':>20} {'per-GEMM dequant':>17} {'ratio':>6} "
        f"{'load-time dequant':>18}"
    )
    for n, k in SHAPES:
        w, scale = quantize_blocks(torch.randn(n, k) * k**-0.5, BLOCK, torch.float8_e4m3fn)
        load_ms = time_ms(
            partial(dequantize_blocks, w, scale, BLOCK, dtype), CPU, iters=10, warmup=1
        )
        dense = dequantize_blocks(w, scale, BLOCK, dtype)
        for tokens in TOKENS:
            x = torch.randn(tokens, k, dtype=dtype)
            at_load = time_ms(partial(torch.matmul, x, dense.t()), CPU, iters=20, warmup=2)
            per_gemm = time_ms(
                partial(naive.w8a8_block_fp8_matmul, x, w, scale, BLOCK), CPU, iters=10, warmup=1
            )
            print(
                f"{n:>5} x {k:<5} {tokens:>6} {at_load:>20.3f} {per_gemm:>17.3f} {per_gemm / at_load:>6.1f} "
                f"{load_ms:>18.3f}"
            )


if __name__ == "__main__":
    main()
