"""The C++ CPU kernels built for each instruction set, side by side with PyTorch's own CPU products, in one run.

    python benchmarks/bench_cpu_isa.py --threads 2 [--isa native,avx2]

Each ISA (``SGLANG_CPU_ISA``: native, avx2, avx512; one this CPU cannot run is skipped, saying so) runs in a process
of its own, since a process loads one build. Cases: linear products of the benchmarks' shapes with float32, bf16
and block-FP8 weights stored [in, out] as the engine stores them (1, 8 and 128 rows; the LM head as the tied
embedding [out, in]) and MXFP4 weights as the checkpoint stores them ([out, in], two e2m1 codes a byte), the fused
MoE at 1 and 128 tokens (float32, bf16 and MXFP4 experts), and the gated delta rule's prefill. The reference column
is PyTorch on float32 weights (``x @ w``: oneDNN / MKL; the naive MoE and delta rule; for MXFP4 the dequantized
weights), its own kernels put on the same ISA (``torch_isa_env``). Prints GFLOP/s of each ISA, and each over
PyTorch; best of ``--repeats`` rounds. ``--formats`` keeps some weight formats only (``--formats mxfp4``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

PRODUCTS = {  # name: (K, N, layout)
    "GDN in_proj 512x3072": (512, 3072, "in_out"),
    "expert down 128x512": (128, 512, "in_out"),
    "big in_proj 1024x6144": (1024, 6144, "in_out"),
    "LM head 512x24000 (tied)": (512, 24000, "out_in"),
}
ROWS = (1, 8, 128)
WEIGHTS = {"f32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "mxfp4": None}
MOE = (32, 512, 128, 4)  # experts, hidden, intermediate, top_k
TOKENS = (1, 128)


def best_seconds(fn, repeats: int, flops: float) -> float:
    calls = max(2, int(5e7 / max(flops, 1.0)))
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _mxfp4_linear_cases(name: str, base: torch.Tensor, gen: torch.Generator):
    """MXFP4 weights [out, in] as Quark exports them, against PyTorch on their float32 dequantization."""
    from sglang_lite.kernels import cpu
    from sglang_lite.kernels.quant import mxfp4

    packed, scales = mxfp4.quantize(base)
    ref_w = mxfp4.dequantize(packed, scales).t().contiguous()
    n, k = base.shape
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen)
        yield (
            f"{name} mxfp4",
            f"{rows} rows",
            2.0 * rows * k * n,
            lambda x=x: cpu.linear_mxfp4(x, packed, scales),
            lambda x=x: x @ ref_w,
        )


def _linear_cases(gen: torch.Generator, formats: list[str]):
    from sglang_lite.kernels import cpu

    for name, (k, n, layout) in PRODUCTS.items():
        base = torch.randn(n, k, generator=gen) / k**0.5
        for label, dtype in WEIGHTS.items():
            if label not in formats:
                continue
            if label == "mxfp4":
                yield from _mxfp4_linear_cases(name, base, gen)
                continue
            if layout == "out_in" and dtype == torch.float8_e4m3fn:
                continue  # FP8 weights are stored [in, out] only
            w = base.to(dtype)
            w = w.t().contiguous().t() if layout == "in_out" else w.contiguous()
            scale = block = None
            if dtype == torch.float8_e4m3fn:
                block = (128, 128)
                scale = torch.ones((n + 127) // 128, (k + 127) // 128)
            ref_w = base.t().contiguous()
            for rows in ROWS:
                x = torch.randn(rows, k, generator=gen)
                ours = (
                    (lambda x=x, w=w, s=scale, b=block: cpu.linear(x, w, s, b))
                    if cpu.takes_linear(x, w, scale, block)
                    else None
                )
                yield (
                    f"{name} {label}",
                    f"{rows} rows",
                    2.0 * rows * k * n,
                    ours,
                    lambda x=x, r=ref_w: x @ r,
                )


def _moe_experts(label: str, gen: torch.Generator):
    """(w13, w2, their scales or None, the float32 experts) of one format, as the engine stores them."""
    from sglang_lite.kernels.quant import mxfp4

    experts, hidden, inter, _ = MOE
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / 8
    w2 = torch.randn(experts, hidden, inter, generator=gen) / 8
    if label == "mxfp4":  # [out, in] as the checkpoint stores them
        (p13, s13), (p2, s2) = mxfp4.quantize(w13), mxfp4.quantize(w2)
        return p13, p2, (s13, s2), mxfp4.dequantize(p13, s13), mxfp4.dequantize(p2, s2)
    w13, w2 = (
        w.to(WEIGHTS[label]).transpose(-1, -2).contiguous().transpose(-1, -2) for w in (w13, w2)
    )
    return w13, w2, (None, None), w13.float(), w2.float()


def _moe_cases(gen: torch.Generator, formats: list[str]):
    from sglang_lite.kernels import cpu
    from sglang_lite.kernels.moe import naive

    experts, hidden, inter, top_k = MOE
    for label in ("f32", "bf16", "mxfp4"):
        if label not in formats:
            continue
        w13, w2, scales, f13, f2 = _moe_experts(label, gen)
        for tokens in TOKENS:
            x = torch.randn(tokens, hidden, generator=gen)
            ids = torch.stack(
                [torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]
            ).int()
            weights = torch.rand(tokens, top_k, generator=gen)
            flops = 2.0 * tokens * top_k * 3 * hidden * inter
            yield (
                f"MoE {experts}x{hidden}->2x{inter} top {top_k} {label}",
                f"{tokens} tokens",
                flops,
                lambda x=x, a=w13, b=w2, tw=weights, i=ids, s=scales: cpu.fused_moe(
                    x, a, b, tw, i, *s
                ),
                lambda x=x, a=f13, b=f2, tw=weights, i=ids: naive.fused_moe(x, a, b, tw, i),
            )


def _delta_rule_cases(gen: torch.Generator, formats: list[str]):
    from sglang_lite.kernels import cpu
    from sglang_lite.kernels.gated_delta_rule import naive

    if "f32" not in formats:  # float32 operands
        return
    tokens, hk, hv, d = 128, 4, 8, 128
    q, k = (
        torch.nn.functional.normalize(torch.randn(tokens, hk, d, generator=gen), dim=-1)
        for _ in range(2)
    )
    v = torch.randn(tokens, hv, d, generator=gen)
    g = -torch.rand(tokens, hv, generator=gen)
    beta = torch.rand(tokens, hv, generator=gen)
    state, slots, bounds = (
        torch.zeros(1, hv, d, d),
        torch.zeros(1, dtype=torch.int32),
        torch.tensor([0, tokens]),
    )
    flops = 6.0 * tokens * hv * d * d
    yield (
        f"gated delta rule {hv} heads x {d}",
        f"{tokens} tokens",
        flops,
        lambda: cpu.chunk_gated_delta_rule(q, k, v, g, beta, state, slots, bounds),
        lambda: naive.chunk_gated_delta_rule(q, k, v, g, beta, state, slots, bounds),
    )


def measure(repeats: int, formats: list[str]) -> list[dict]:
    """This process's ISA: every case's GFLOP/s, ours and PyTorch's."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for cases in (_linear_cases, _moe_cases, _delta_rule_cases):
        for name, what, flops, ours, reference in cases(gen, formats):
            row = {"case": name, "size": what}
            row["ours"] = flops / best_seconds(ours, repeats, flops) / 1e9 if ours else None
            row["torch"] = flops / best_seconds(reference, repeats, flops) / 1e9
            out.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return out


def run_isa(isa: str, args: argparse.Namespace) -> tuple[str, list[dict]] | None:
    from sglang_lite.kernels import cpu

    # PyTorch's own kernels on the same ISA: the reference column is then what that ISA's CPU would run
    env = {
        **os.environ,
        "SGLANG_CPU_ISA": isa,
        "OMP_NUM_THREADS": str(args.threads),
        **cpu.torch_isa_env(isa),
    }
    command = [
        sys.executable,
        __file__,
        "--child",
        "--threads",
        str(args.threads),
        "--repeats",
        str(args.repeats),
        "--formats",
        args.formats,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(
            f"{isa}: skipped ({done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode})"
        )
        return None
    result = json.loads(done.stdout)
    return result["isa"], result["rows"]


def print_table(results: dict[str, list[dict]]) -> None:
    """Per ISA: PyTorch on that ISA, ours, and ours over PyTorch."""
    isas = list(results)
    names = [i.split()[0] for i in isas]
    print(f"\nGFLOP/s, {time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.1f}")
    print(
        f"{'case':<40}{'size':>11}"
        + "".join(f"{'torch ' + n:>14}{n:>9}{'ratio':>8}" for n in names)
    )
    for j, row in enumerate(results[isas[0]]):
        line = f"{row['case']:<40}{row['size']:>11}"
        for isa in isas:
            theirs, ours = results[isa][j]["torch"], results[isa][j]["ours"]
            line += f"{theirs:>14.1f}" + (
                f"{ours:>9.1f}{ours / theirs:>7.2f}x" if ours else f"{'-':>9}{'-':>8}"
            )
        print(line)
    print("ISAs: " + "; ".join(isas))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--isa", default="native,avx2", help="comma-separated SGLANG_CPU_ISA values"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--formats", default=",".join(WEIGHTS), help="comma-separated weight formats to measure"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        from sglang_lite.kernels import cpu

        cpu.require()
        print(
            json.dumps(
                {
                    "isa": f"{cpu.describe_isa()}",
                    "rows": measure(args.repeats, args.formats.split(",")),
                }
            )
        )
        return
    results = {}
    for isa in args.isa.split(","):
        print(f"measuring {isa} ...", flush=True)
        got = run_isa(isa, args)
        if got:
            results[got[0]] = got[1]
    if results:
        print_table(results)


if __name__ == "__main__":
    main()
