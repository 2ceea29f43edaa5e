"""Without a GPU: compile every Triton kernel, at the launch configurations the GPU checks use, for NVIDIA sm_90
(H100 / H200) and AMD gfx942 (MI300), and report registers, spilled stack and shared memory per thread block.

The kernel cases' GPU checks (benchmarks/kernel_cases, real model sizes) run on CPU tensors with every Triton
launch recorded instead of run; each recorded configuration is then compiled ahead of time for both targets with
the compilers in Triton's own package (no GPU, no driver). A configuration fails when it needs more shared memory
than the chip has (on an H200 that was an OutOfResources error at the first launch); spilled stack is flagged, as
a cost to weigh rather than an error (spills made a norm kernel run at a few percent of memory bandwidth).

    python benchmarks/triton_resources.py [--targets sm90,gfx942]
"""

from __future__ import annotations

import argparse
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
}
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
    def name(self) -> str:
        """Kernel, data type and the constexprs it declares plus launch options (not the specialised 1s)."""
        declared = {p.name for p in self.kernel.params if p.is_constexpr}
        shown = [(k, v) for k, v in self.constexprs if k in declared] + list(self.options)
        data = next((t[1:] for _, t in self.signature if t.startswith("*")), "")
        return f"{self.kernel.fn.__name__} {data} [{', '.join(f'{k}={v}' for k, v in shown)}]"


def record_launches(hip_version: str | None, arch: str) -> list[Launch]:
    """Every distinct launch configuration of the kernel cases' checks, specialised as Triton's launcher does
    (integers equal to 1 become constants; 16-divisible integers and 16-aligned pointers are marked), with the
    platform the launchers see (it decides, for one, the dot precision) set to the target's."""
    launches: dict[Launch, None] = {}

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
        launches[Launch(self, tuple(signature), tuple(constexprs), tuple(aligned), options)] = None

    real = JITFunction.run, dispatch.triton_interpreting, dispatch._hip_arch, torch.version.hip
    # CPU tensors may take the Triton side
    JITFunction.run, dispatch.triton_interpreting = record, lambda: True
    dispatch._hip_arch, torch.version.hip = (lambda: arch), hip_version
    try:
        for module in load_cases():
            if module.__name__.endswith("alt_streams"):
                continue  # whole models on GPU streams; their kernels are the other families'
            try:
                module.check(torch.device("cpu"))
            except Exception:  # noqa: BLE001 - outputs are never written, so checks may fail after their launches
                pass
    finally:
        JITFunction.run, dispatch.triton_interpreting, dispatch._hip_arch, torch.version.hip = real
    return list(launches)


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


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--targets", default=",".join(TARGETS))
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    print(
        f"Triton {triton.__version__}; regs: per thread (NVIDIA) or vector registers per lane (AMD)\n"
    )
    print(f"{'target':<7} {'regs':>5} {'stack B':>8} {'shared KB':>10} {'compile s':>9}  kernel")
    failures = spills = 0
    for name in args.targets.split(","):
        target, shared_limit, hip_version = TARGETS[name]
        for launch in record_launches(hip_version, str(target.arch)):
            try:
                r = resources(launch, target)
            except Exception as exc:  # noqa: BLE001 - a compile error is a finding, not the end of the report
                print(
                    f"{name:<7} {'compile error':>34}  {launch.name}: {type(exc).__name__}: {str(exc)[:200]}"
                )
                failures += 1
                continue
            too_big = r["shared"] > shared_limit
            failures += too_big
            spills += r["stack"] > 0
            mark = "  <-- FAIL: shared memory" if too_big else "  (spills)" if r["stack"] else ""
            print(
                f"{name:<7} {r['regs']:>5} {r['stack']:>8} {r['shared'] / 1024:>10.1f} {r['seconds']:>9.1f}  "
                f"{launch.name}{mark}",
                flush=True,
            )
    print(
        f"\n{failures} configuration(s) fail (shared memory or compile error); {spills} spill registers"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
