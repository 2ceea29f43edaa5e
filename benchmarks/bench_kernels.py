"""Time every kernel case (benchmarks/kernel_cases) and print one table.

On a GPU: our Triton kernels, median of CUDA-event timings, with the achieved bandwidth as a share of a measured
device copy and TFLOP/s as a share of a measured bf16 matmul. On the CPU: our PyTorch path against the
transformers reference functions on the same inputs, in a process that keeps freed heap memory (as our scheduler
processes do) so that neither side's timings are page faults of fresh allocations. ``--quick`` shrinks the shapes;
``--threads`` sets torch's CPU threads.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_cases import load_cases  # noqa: E402
from kernel_cases._timing import time_ms  # noqa: E402

from sglang_lite.utils.process import keep_freed_heap_memory  # noqa: E402


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    src = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, iters=20)
    return 2 * src.numel() / (ms * 1e-3)


def matmul_peak(
    device: torch.device, dtype: torch.dtype = torch.bfloat16, size: int = 8192
) -> float:
    """FLOP/s of a large matmul."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    ms = time_ms(lambda: a @ a, device, iters=20)
    return 2 * size**3 / (ms * 1e-3)


def collect(device: torch.device, quick: bool) -> list[dict]:
    rows = []
    for module in tqdm(load_cases(), desc="kernel cases", unit="family"):
        rows += module.bench(device, quick)
    return rows


def format_table(rows: list[dict], bandwidth: float | None, peak: float | None) -> str:
    """GPU: bandwidth and matmul-peak shares of our kernels. CPU (``peak`` only): our share of the matmul peak, and
    the ceiling of ref/ours, peak over the reference's FLOP rate: no path doing the row's FLOPs can beat it."""
    header = (
        f"{'kernel':34} {'shape':40} {'ours ms':>9} {'reference':34} {'ref ms':>9} {'ref/ours':>8}"
    )
    header += (
        f" {'%copy BW':>8} {'%mm peak':>8}"
        if bandwidth
        else f" {'%mm peak':>8} {'ceiling':>8}"
        if peak
        else ""
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        line = (
            f"{r['kernel'][:34]:34} {r['shape'][:40]:40} {r['ours_ms']:9.3f} {r['ref_name'][:34]:34} "
            f"{r['ref_ms']:9.3f} {r['ref_ms'] / r['ours_ms']:8.2f}"
        )
        seconds, flops = r["ours_ms"] * 1e-3, r.get("flops")
        share = f"{100 * flops / seconds / peak:7.1f}%" if flops and peak else ""
        if bandwidth:
            bw = f"{100 * r['bytes'] / seconds / bandwidth:7.1f}%" if r.get("bytes") else ""
            line += f" {bw:>8} {share:>8}"
        elif peak:
            ceiling = f"{peak * r['ref_ms'] * 1e-3 / flops:8.2f}" if flops else ""
            line += f" {share:>8} {ceiling:>8}"
        lines.append(line)
    return "\n".join(lines)


def run_table(device: torch.device, quick: bool) -> str:
    bandwidth = peak = None
    if device.type == "cuda":
        bandwidth, peak = copy_bandwidth(device), matmul_peak(device)
        print(
            f"device copy bandwidth {bandwidth / 1e9:.0f} GB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s"
        )
    else:
        peak = matmul_peak(device, torch.float32, 2048)
        print(
            f"fp32 matmul {peak / 1e9:.0f} GFLOP/s; 'ceiling': the best ref/ours any path doing the FLOPs can reach"
        )
    return format_table(collect(device, quick), bandwidth, peak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes, fewer iterations")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    if device.type == "cpu":
        keep_freed_heap_memory()
        print(
            f"CPU, {torch.get_num_threads()} threads: our PyTorch path ('ours') against the transformers reference "
            "functions"
        )
    print(run_table(device, args.quick))


if __name__ == "__main__":
    main()
