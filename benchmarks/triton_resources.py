"""Without a GPU: compile every Triton kernel, at the launch configurations the GPU checks use, for NVIDIA sm_90
(H100 / H200), AMD gfx942 (MI300) and AMD gfx950 (MI355X), and report registers, spilled stack and shared memory
per thread block in one table (a row per configuration, a column group per target).

The kernel cases' GPU checks (benchmarks/kernel_cases, real model sizes) run on CPU tensors with every Triton
launch recorded instead of run, once per target with the platform the launchers see set to the target's (the
launchers pick some tiles per target, and on gfx950 ``tl.dot_scaled`` for the MXFP4 products); each recorded
configuration is then compiled ahead of time with the compilers in Triton's own package (no GPU, no driver). A
configuration fails when it needs more shared memory than the chip has (on an H200 that was an OutOfResources
error at the first launch) or spills more than ``MAX_SPILL_BYTES`` a thread (spills made a norm kernel run at a
few percent of memory bandwidth); smaller spills are marked, as a cost to weigh. Shared memory per block: 227 KB
on sm_90; LDS per workgroup 64 KB on gfx942 and 160 KB on gfx950 (AMD's GPU specifications, CDNA3 and CDNA4).

    python benchmarks/triton_resources.py [--targets sm90,gfx942,gfx950]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_cases import load_cases  # noqa: E402

import sglang_lite.kernels.dispatch as dispatch  # noqa: E402

TARGETS = {  # name -> (target, shared memory per block in bytes, torch.version.hip while recording)
    "sm90": (GPUTarget("cuda", 90, 32), 232448, None),
    "gfx942": (GPUTarget("hip", "gfx942", 64), 65536, "6.4"),
    "gfx950": (GPUTarget("hip", "gfx950", 64), 163840, "7.0"),
}
MAX_SPILL_BYTES = 512  # per thread (NVIDIA) or lane (AMD)
LAUNCH_OPTIONS = ("num_warps", "num_stages")


@dataclass(frozen=True)
class Launch:
    kernel: JITFunction
    signature: tuple[tuple[str, str], ...]  # every parameter: its type, or "constexpr"
    constexprs: tuple[tuple[str, object], ...]
    # parameters the launcher would mark 16-divisible (enables vector and async copies)
    aligned: tuple[int, ...]
    options: tuple[tuple[str, int], ...]

    @property
    def data(self) -> str:
        """The element type of the first pointer argument."""
        return next((t[1:] for _, t in self.signature if t.startswith("*")), "")

    @property
    def shown(self) -> list[tuple[str, object]]:
        """The constexprs the kernel declares plus launch options (not the specialised 1s)."""
        declared = {p.name for p in self.kernel.params if p.is_constexpr}
        return [(k, v) for k, v in self.constexprs if k in declared] + list(self.options)

    @property
    def name(self) -> str:
        fields = ", ".join(f"{k}={v}" for k, v in self.shown)
        return f"{self.kernel.fn.__name__} {self.data} [{fields}]"


def record_launches(hip_version: str | None, arch: str) -> list[Launch]:
    """Every launch of the kernel cases' checks in call order, specialised as Triton's launcher does (integers
    equal to 1 become constants; 16-divisible integers and 16-aligned pointers are marked), with the platform the
    launchers see (it decides the dot precision and some tiles) set to the target's. The checks run the same
    calls on every target, so the i-th launch of one target is the same call as the i-th of another."""
    launches: list[Launch] = []

    def record(self: JITFunction, *args, grid=None, warmup=False, **kwargs):
        bound = dict(zip(self.arg_names, args)) | kwargs
        signature, constexprs, aligned = [], [], []
        for i, param in enumerate(self.params):
            value = bound[param.name]
            if param.is_constexpr:
                kind, spec = "constexpr", None
            else:
                kind, spec = native_specialize_impl(
                    BaseBackend,
                    value,
                    False,
                    not param.do_not_specialize,
                    not param.do_not_specialize_on_alignment,
                )
            signature.append((param.name, kind))
            if kind == "constexpr":
                constexprs.append((param.name, value))
            elif spec == "D":
                aligned.append(i)
        options = tuple((k, bound[k]) for k in LAUNCH_OPTIONS if k in bound)
        launches.append(Launch(self, tuple(signature), tuple(constexprs), tuple(aligned), options))

    real = JITFunction.run, dispatch.triton_interpreting, dispatch._hip_arch, torch.version.hip
    empty = torch.empty, torch.empty_like
    # CPU tensors may take the Triton side
    JITFunction.run, dispatch.triton_interpreting = record, lambda: True
    dispatch._hip_arch, torch.version.hip = (lambda: arch), hip_version
    # outputs are never written: zeros, not leftover memory, so that what the checks do with them next (routing,
    # sizes) is the same on every target
    torch.empty, torch.empty_like = torch.zeros, torch.zeros_like
    try:
        for module in load_cases():
            if module.__name__.endswith("alt_streams"):
                continue  # whole models on GPU streams; their kernels are the other families'
            torch.manual_seed(0)
            try:
                module.check(torch.device("cpu"))
            except Exception:  # noqa: BLE001 - outputs are never written, so checks may fail after their launches
                pass
    finally:
        JITFunction.run, dispatch.triton_interpreting, dispatch._hip_arch, torch.version.hip = real
        torch.empty, torch.empty_like = empty
    return launches


def resources(launch: Launch, target: GPUTarget) -> dict:
    """Registers, stack and shared memory of one compiled configuration (from the binary's resource table)."""
    attrs = {(i,): [["tt.divisibility", 16]] for i in launch.aligned}
    source = ASTSource(
        fn=launch.kernel,
        signature=dict(launch.signature),
        constexprs=dict(launch.constexprs),
        attrs=attrs,
    )
    start = time.perf_counter()
    compiled = triton.compile(source, target=target, options=dict(launch.options))
    seconds = time.perf_counter() - start
    if target.backend == "cuda":
        tool = os.path.join(
            os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"
        )
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            usage = subprocess.run(
                [tool, "--dump-resource-usage", f.name], capture_output=True, text=True
            ).stdout
        fields = dict(
            item.split(":")
            for line in usage.splitlines()
            if "REG:" in line
            for item in line.split()
            if item.count(":") == 1
        )
        regs, stack = int(fields["REG"]), int(fields["STACK"])
    else:  # AMD: the assembly's metadata block gives vector registers and scratch (spill) bytes per lane
        asm = compiled.asm["amdgcn"]
        regs = int(re.search(r"\.vgpr_count:\s+(\d+)", asm).group(1))
        stack = int(re.search(r"\.private_segment_fixed_size:\s+(\d+)", asm).group(1))
    return {"regs": regs, "stack": stack, "shared": compiled.metadata.shared, "seconds": seconds}


def missing_compiler(name: str) -> str | None:
    """Why this Triton cannot compile for the target here (None when it can)."""
    target = TARGETS[name][0]
    backends = os.path.join(os.path.dirname(triton.__file__), "backends")
    if target.backend == "cuda":
        for tool in ("ptxas", "cuobjdump"):
            if not os.path.exists(os.path.join(backends, "nvidia", "bin", tool)):
                return f"this Triton {triton.__version__} ships no {tool} (backends/nvidia/bin)"
        return None
    try:
        from triton._C.libtriton import amd  # noqa: F401
    except ImportError as exc:
        return f"this Triton {triton.__version__} has no AMD backend: {exc}"
    return None


def compile_one(name: str, launch: Launch) -> dict | str:
    """Resources of one launch on the target, or the compile error's text."""
    try:
        return resources(launch, TARGETS[name][0])
    except Exception as exc:  # noqa: BLE001 - a compile error is a finding, not the end of the report
        return f"{type(exc).__name__}: {str(exc)[:200]}"


# Distinct launches per target, set before the compiling processes fork (launches hold kernels, which do not
# pickle; a forked child reads them from here and sends back plain dicts).
_PENDING: dict[str, list[Launch]] = {}


def _compile_share(job: tuple[str, int, int]) -> list[dict | str]:
    """Launches first, first + step, ... of the target's."""
    name, first, step = job
    return [compile_one(name, launch) for launch in _PENDING[name][first::step]]


def compile_targets(per_target: dict[str, list[Launch]], workers: int) -> dict[str, dict]:
    """Resources of every distinct launch of every target ({target: {launch: resources or error}}). Compiling
    takes ~2.5 minutes on one core for the three targets (every compile starts from nothing in a fresh Triton
    cache), so each target's launches are shared out to ``workers`` forked processes."""
    _PENDING.clear()
    _PENDING.update({name: list(dict.fromkeys(calls)) for name, calls in per_target.items()})
    jobs = [(name, first, workers) for name in _PENDING for first in range(workers)]
    if workers > 1:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            shares = pool.map(_compile_share, jobs, chunksize=1)
    else:
        shares = [_compile_share(job) for job in jobs]
    out: dict[str, list] = {name: [None] * len(launches) for name, launches in _PENDING.items()}
    for (name, first, step), share in zip(jobs, shares):
        out[name][first::step] = share
    return {name: dict(zip(launches, out[name])) for name, launches in _PENDING.items()}


def verdict(name: str, r: dict | str) -> str:
    """'' (fits), 'spills' (under the limit), or why the configuration fails on the target."""
    if isinstance(r, str):
        return "FAIL compile"
    if r["shared"] > TARGETS[name][1]:
        return "FAIL shared"
    if r["stack"] > MAX_SPILL_BYTES:
        return "FAIL spills"
    return "spills" if r["stack"] else ""


def row_label(launches: tuple[Launch, ...]) -> str:
    """The call's kernel, data type and parameters; a value that differs per target reads ``a/b/c``."""

    def joined(values: list[object]) -> str:
        return str(values[0]) if len(set(values)) == 1 else "/".join(map(str, values))

    fields = [dict(la.shown) for la in launches]
    keys = dict.fromkeys(k for f in fields for k in f)
    shown = ", ".join(f"{k}={joined([f.get(k, '-') for f in fields])}" for k in keys)
    data = joined([la.data for la in launches])
    return f"{launches[0].kernel.fn.__name__} {data} [{shown}]"


def table(
    names: list[str], calls: list[tuple[Launch, ...]], results: dict[str, dict]
) -> tuple[str, int, int]:
    """One row per distinct call (targets in columns): regs, spilled bytes and shared KB; failures, spills."""
    width = 24
    head = "".join(f"{n + ': regs spill shKB':>{width}}" for n in names)
    lines = [f"{head}  kernel (a/b/c: per-target values)"]
    failures = spills = 0
    for row in dict.fromkeys(calls):
        cells, marks = [], []
        for name, launch in zip(names, row):
            r = results[name][launch]
            mark = verdict(name, r)
            failures += mark.startswith("FAIL")
            spills += mark == "spills"
            if isinstance(r, str):
                cells.append(f"{'compile error':>{width}}")
                marks.append(f"{name}: {r}")
                continue
            cells.append(f"{r['regs']:>{width - 14}} {r['stack']:>6} {r['shared'] / 1024:>6.1f}")
            if mark:
                marks.append(f"{name} {mark}")
        note = f"  <-- {'; '.join(marks)}" if marks else ""
        lines.append(f"{''.join(cells)}  {row_label(row)}{note}")
    return "\n".join(lines), failures, spills


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--json", help="also write the results here (per target: skipped or rows)")
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="processes compiling at once (default: one per core)",
    )
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    names, skipped = [], {}
    for name in args.targets.split(","):
        reason = missing_compiler(name)
        if reason:
            skipped[name] = reason
            print(f"skipped {name}: {reason}")
        else:
            names.append(name)
    start = time.perf_counter()
    per_target = [record_launches(TARGETS[n][2], str(TARGETS[n][0].arch)) for n in names]
    results = compile_targets(dict(zip(names, per_target)), args.workers)
    if len({len(calls) for calls in per_target}) > 1:
        raise SystemExit("the checks made different calls per target: rows cannot be matched")
    calls = list(zip(*per_target))
    print(
        f"Triton {triton.__version__}; regs: per thread (NVIDIA) or vector registers per lane (AMD); spill: "
        f"stack bytes per thread/lane (> {MAX_SPILL_BYTES} fails); shKB: shared memory (LDS) per block, limits "
        + ", ".join(f"{n} {TARGETS[n][1] // 1024} KB" for n in names)
        + f"; compiled in {time.perf_counter() - start:.0f} s\n"
    )
    text, failures, spills = table(names, calls, results)
    print(text)
    print(
        f"\n{failures} configuration(s) fail (shared memory, spills over {MAX_SPILL_BYTES} B or compile "
        f"error); {spills} spill registers under the limit"
    )
    if args.json:
        report = {n: {"skipped": r} for n, r in skipped.items()}
        for name in names:
            rows = [
                {"kernel": la.name, "verdict": verdict(name, r)}
                | (r if isinstance(r, dict) else {"error": r})
                for la, r in results[name].items()
            ]
            report[name] = {"rows": rows}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
