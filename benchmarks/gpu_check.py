"""On a GPU: every kernel case's correctness check, the model and serving checks of gpu_model_check.py, then the
kernels' timings as shares of the device's copy bandwidth and of its bf16 or FP8 matmul peak; one table at the end
(under 10 minutes on one H200).

Kernel checks: the Triton kernels against the PyTorch references (benchmarks/kernel_cases), the block-FP8 GEMM
and the FP8 fused MoE also against bf16 arithmetic on the dequantized weights and replayed from a CUDA graph; the
MXFP4 (weight-only) linear and fused MoE in each activation dtype, through ``tl.dot_scaled`` on gfx950 (MI355X) and
a dequantized tile elsewhere, timed against the same kernels on the bf16 weights the codes stand for.
Model checks: see gpu_model_check.py (CUDA-graph decode with the alt-stream plan on and off, FP8 weights in the
graphs, TP=2 over NCCL/RCCL where two GPUs exist, penalties, a grammar, ``n`` > 1 and the prefix cache in
captured batches). Exits non-zero when any check fails; on a machine without a GPU the default says so and exits 0.

``--device cpu`` is the dry run: the same checks with the Triton kernels in Triton's interpreter
(``TRITON_INTERPRET=1``) at the same shapes, the model checks on the CPU (no graphs; TP=2 over gloo), no timings.

    python benchmarks/gpu_check.py [--device cpu] [--families fp8,moe,mxfp4] [--no-models] [--no-bench]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--families", help="kernel families to check (default: all)")
    parser.add_argument("--no-models", action="store_true", help="skip gpu_model_check's checks")
    parser.add_argument("--no-bench", action="store_true", help="skip the timings")
    return parser.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.device == "cpu":
    os.environ["TRITON_INTERPRET"] = (
        "1"  # read when the kernels are defined: before they are imported
    )

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import collect, copy_bandwidth, matmul_peak  # noqa: E402
from kernel_cases import load_cases  # noqa: E402
from kernel_cases._timing import time_ms  # noqa: E402


def run_checks(device: torch.device, families: set[str] | None = None) -> list[dict]:
    """Each kernel family's check rows as (section, name, ok, detail); a crash is one failed row."""
    rows = []
    for module in load_cases():
        family = module.__name__.rsplit(".", 1)[-1]
        if families is not None and family not in families:
            continue
        start = time.perf_counter()
        try:
            results = module.check(device)
        except Exception as exc:  # a crash in one family must not hide the others' results
            detail = f"{type(exc).__name__}: {exc} | {traceback.format_exc(limit=-2)!r}"
            rows.append(_row(family, "crashed", False, detail[:300], start))
            continue
        for r in results:
            rows.append(
                _row(family, r["name"], r["ok"], f"max rel err {r['max_rel_err']:.2e}", start)
            )
            start = time.perf_counter()
        print(f"{family}: {len(results)} checks", flush=True)
    return rows


def _row(section: str, name: str, ok: bool, detail: str, start: float) -> dict:
    return {
        "section": section,
        "name": name,
        "ok": bool(ok),
        "detail": detail,
        "seconds": time.perf_counter() - start,
    }


def fp8_matmul_peak(device: torch.device, n: int = 8192) -> float:
    """FLOP/s of torch's FP8 GEMM (``torch._scaled_mm``, bf16 out) at n x n x n in the device's FP8 format."""
    from sglang_lite.kernels import fp8_dtype

    dtype = fp8_dtype(device)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype).t()
    one = torch.ones((), device=device)

    def gemm() -> torch.Tensor:
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    return 2 * n**3 / (time_ms(gemm, device, iters=20) * 1e-3)


def bench_rows(device: torch.device) -> list[dict]:
    """The quick timing table as rows: bandwidth share for memory-bound kernels, else the matmul peak share
    (the FP8 peak for FP8 kernels)."""
    bandwidth, peak = copy_bandwidth(device), matmul_peak(device)
    try:
        fp8_peak = fp8_matmul_peak(device)
    except Exception as exc:  # noqa: BLE001 - an FP8 GEMM torch cannot run here leaves that column empty
        print(f"no FP8 peak: {type(exc).__name__}: {exc}")
        fp8_peak = None
    start = time.perf_counter()
    rows = [
        _row(
            "peaks",
            "copy bandwidth, bf16 and FP8 matmul",
            True,
            f"{bandwidth / 1e9:.0f} GB/s, {peak / 1e12:.0f} TFLOP/s, "
            + (f"{fp8_peak / 1e12:.0f} TFLOP/s" if fp8_peak else "FP8 n/a"),
            start,
        )
    ]
    for r in collect(device, quick=True):
        seconds = r["ours_ms"] * 1e-3
        detail = f"{r['ours_ms']:.3f} ms, {r['ref_name']} {r['ref_ms']:.3f} ms"
        if r.get("bytes"):
            detail += f", {100 * r['bytes'] / seconds / bandwidth:.0f}% of copy BW"
        elif r.get("flops"):
            fp8 = "fp8" in r["kernel"]
            ceiling = fp8_peak if fp8 else peak
            if ceiling:
                share = 100 * r["flops"] / seconds / ceiling
                detail += f", {share:.1f}% of the {'FP8' if fp8 else 'bf16'} peak"
        rows.append(_row("bench", f"{r['kernel']} {r['shape']}", True, detail, start))
        start = time.perf_counter()
    return rows


def format_table(rows: list[dict]) -> str:
    width = min(72, max(len(r["name"]) for r in rows))
    lines = [f"{'section':<16} {'check':<{width}} {'result':<6} {'s':>6}  detail"]
    for r in rows:
        result = "PASS" if r["ok"] else "FAIL"
        if r["section"] in ("bench", "peaks"):
            result = "time"
        name = r["name"] if len(r["name"]) <= width else r["name"][: width - 1] + "~"
        lines.append(
            f"{r['section']:<16} {name:<{width}} {result:<6} {r['seconds']:>6.1f}  {r['detail']}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no GPU found: nothing to check (--device cpu for the dry run, or the CPU tests)")
        return 0
    device = torch.device(args.device)
    start = time.perf_counter()
    families = set(args.families.split(",")) if args.families else None
    rows = run_checks(device, families)
    if not args.no_models:
        from gpu_model_check import run_model_checks

        for r in run_model_checks(args.device):
            rows.append({"section": "model", **r})
    if device.type == "cuda" and not args.no_bench:
        torch.cuda.synchronize()
        rows += bench_rows(device)
    failed = [r for r in rows if not r["ok"]]
    print("\n" + format_table(rows))
    checks = [r for r in rows if r["section"] not in ("bench", "peaks")]
    print(
        f"\n{len(checks) - len(failed)}/{len(checks)} checks passed on {args.device} "
        f"in {time.perf_counter() - start:.0f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
