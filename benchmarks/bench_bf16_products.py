"""bf16 products of the C++ CPU kernels on each path, side by side in one run: `vdpbf16ps` (SGLANG_CPU_BF16_DOT=dot)
against widening to float32 (widen, with its packed blocks from 9 rows on), and what `auto` chooses on this CPU.

    python benchmarks/bench_bf16_products.py --threads 2

Rows: projections of the benchmarks' shapes (K x N of a bf16 weight stored [in, out], as the engine stores them on
the CPU; mid's GDN input projection and LM head, the between shape's and big's GDN input projections, MoE experts'
down projections) at 1 to 128 rows, and whole MoE layers (`fused_moe`, random routing) at 1 to 512 tokens. Each
case alternates the modes within each of ``--repeats`` rounds and keeps the best (a shared host only slows a run
down). Prints GFLOP/s of each mode, widen over dot, and this CPU's `bf16_dot_speed()` (vdpbf16ps's products per
second over the float32 FMA's, from which auto decides).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from tqdm import tqdm

from sglang_lite.kernels import cpu

MODES = ("dot", "widen", "auto")
PRODUCTS = {  # name: (K, N)
    "mid GDN in_proj 256x1536": (256, 1536),
    "mid LM head 256x32000": (256, 32000),
    "between GDN in_proj 512x3072": (512, 3072),
    "expert down 128x512": (128, 512),
    "big GDN in_proj 1024x6144": (1024, 6144),
}
ROWS = (1, 2, 8, 16, 32, 64, 128)
MOES = {  # name: (experts, hidden, intermediate, top_k)
    "mid MoE 16 x 256->2x128, top 4": (16, 256, 128, 4),
    "between MoE 32 x 512->2x128, top 8": (32, 512, 128, 8),
}
TOKENS = (1, 32, 128, 512)


def best_seconds(fn, calls: int, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def side_by_side(fn, flops: float, repeats: int) -> dict[str, float]:
    """GFLOP/s of ``fn`` under each mode, the modes alternating within each round."""
    seconds = {mode: float("inf") for mode in MODES}
    calls = max(3, int(2e8 / max(flops, 1.0)))  # ~0.1 s a timing at ~200 GFLOP/s
    for _ in range(repeats):
        for mode in MODES:
            os.environ["SGLANG_CPU_BF16_DOT"] = mode
            seconds[mode] = min(seconds[mode], best_seconds(fn, calls, 3))
    return {mode: flops / seconds[mode] / 1e9 for mode in MODES}


def input_major(w: torch.Tensor) -> torch.Tensor:
    """[..., out, in] values stored [in, out], as the engine lays weights out on the CPU."""
    return w.transpose(-1, -2).contiguous().transpose(-1, -2)


def cases(gen: torch.Generator):
    for name, (k, n) in PRODUCTS.items():
        w = input_major(torch.randn(n, k, generator=gen).to(torch.bfloat16))
        for rows in ROWS:
            x = torch.randn(rows, k, generator=gen)
            yield name, f"{rows} rows", 2.0 * rows * k * n, lambda x=x, w=w: cpu.linear(x, w)
    for name, (experts, hidden, inter, top_k) in MOES.items():
        w13 = input_major(
            (torch.randn(experts, 2 * inter, hidden, generator=gen) / 8).to(torch.bfloat16)
        )
        w2 = input_major(
            (torch.randn(experts, hidden, inter, generator=gen) / 8).to(torch.bfloat16)
        )
        for tokens in TOKENS:
            x = torch.randn(tokens, hidden, generator=gen)
            picks = [torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]
            ids = torch.stack(picks).to(torch.int32)
            weights = torch.rand(tokens, top_k, generator=gen)
            flops = 2.0 * tokens * top_k * 3 * hidden * inter

            def run(x=x, w13=w13, w2=w2, weights=weights, ids=ids):
                return cpu.fused_moe(x, w13, w2, weights, ids)

            yield name, f"{tokens} tokens", flops, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the modes alternating")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu.require()
    if not cpu.has_dpbf16():
        raise SystemExit(
            "this CPU has no AVX512-BF16: every mode widens, there is nothing to compare"
        )
    saved = os.environ.get("SGLANG_CPU_BF16_DOT")
    gen = torch.Generator().manual_seed(0)
    all_cases = list(cases(gen))
    lines = []
    try:
        for name, size, flops, fn in tqdm(all_cases, desc="cases", unit="case"):
            rate = side_by_side(fn, flops, args.repeats)
            lines.append(
                f"| {name} | {size} | {rate['dot']:.1f} | {rate['widen']:.1f} | "
                f"{rate['widen'] / rate['dot']:.2f}x | {rate['auto']:.1f} |"
            )
    finally:
        if saved is None:
            os.environ.pop("SGLANG_CPU_BF16_DOT", None)
        else:
            os.environ["SGLANG_CPU_BF16_DOT"] = saved
    print(
        f"\n{args.threads} threads, best of {args.repeats} alternating rounds, load average "
        f"{os.getloadavg()[0]:.1f}; bf16_dot_speed() = {cpu.bf16_dot_speed():.2f} "
        "(auto takes vdpbf16ps beyond two rows from 1.5)"
    )
    print("| case | size | dot GFLOP/s | widen GFLOP/s | widen / dot | auto GFLOP/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
