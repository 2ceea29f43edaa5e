"""llama.cpp for ``bench_llamacpp.py``: built once from the ``llama-cpp-python`` sdist (which vendors llama.cpp,
its GGUF converter and ``gguf-py``), cached under the user's cache folder, and the converter run on a checkpoint.

    python benchmarks/llamacpp_build.py [--version 0.3.36] [--isa avx2]   # build now (~10 min on 2 cores), say where

One build per ISA: ``native`` (``-DGGML_NATIVE=ON``: every extension of this CPU), ``avx2`` (x86-64-v3: AVX2, FMA,
F16C, BMI2, no AVX-512, so that an AVX-512 host measures what an AVX2-only CPU runs) and ``avx512`` (x86-64-v4
plus what this CPU has of AVX512-BF16/VNNI), the same targets as ``SGLANG_CPU_ISA`` forces on our kernels. On a CPU
with AMX the native build leaves AMX out (``-mno-amx-*``, folder ``build-noamx``): llama.cpp 0.3.36's AMX matrix
product (``ggml_backend_amx_mul_mat``) dies with SIGSEGV on these models' Q8_0 and Q4_0 tensors (a Xeon with
amx_int8, 2026-12-08), while the build without it keeps its repacked AVX-512 paths and runs.

The build needs cmake and a C++ compiler; without them it stops with a message saying which is missing. The sdist
is fetched with pip (``pip download --no-binary :all:``) the first time, into the same cache folder.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass

from sglang_lite.kernels.cpu import cpu_flags

DEFAULT_VERSION = "0.3.36"
TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize")
ISAS = ("native", "avx2", "avx512")
_X86_V3 = ["-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON"]
# GCC keeps an explicit -mno-X over what -march=native implies, wherever ggml puts the -march
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
_ISA_OPTIONS = {
    "native": ["-DGGML_NATIVE=ON"],
    "avx2": ["-DGGML_NATIVE=OFF", *_X86_V3, "-DGGML_AVX512=OFF"],
    "avx512": ["-DGGML_NATIVE=OFF", *_X86_V3, "-DGGML_AVX512=ON"],
}


class BuildError(RuntimeError):
    """llama.cpp could not be fetched or built; the message says what to install or do."""


@dataclass(frozen=True)
class LlamaCpp:
    source: str  # vendor/llama.cpp of the sdist
    bin_dir: str
    version: str

    def tool(self, name: str) -> str:
        return os.path.join(self.bin_dir, name)

    @property
    def converter(self) -> str:
        return os.path.join(self.source, "convert_hf_to_gguf.py")


def host_cpu() -> str:
    """This host's CPU model as /proc/cpuinfo names it (for the tables: a figure holds for the host it ran on)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("model name")), "")
    except OSError:
        line = ""
    return line.partition(":")[2].strip() or "an unknown CPU"


def cache_dir(version: str) -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sglang_lite", f"llama.cpp-{version}")


def ensure_llamacpp(version: str = DEFAULT_VERSION, jobs: int = 2, isa: str = "native") -> LlamaCpp:
    """The cached build of llama.cpp as vendored in ``llama-cpp-python==version`` for ``isa`` (one build folder
    each), built first when missing."""
    if isa not in ISAS:
        raise BuildError(f"isa must be one of {ISAS}, got {isa!r}")
    root = cache_dir(version)
    build = os.path.join(root, _build_folder(isa))
    built = LlamaCpp(
        os.path.join(root, "src", "vendor", "llama.cpp"), os.path.join(build, "bin"), version
    )
    missing = [t for t in TOOLS if not os.path.exists(built.tool(t))]
    if not missing and os.path.exists(built.converter):
        return built
    _check_toolchain()
    os.makedirs(root, exist_ok=True)
    if not os.path.exists(built.converter):
        _unpack(_download(version, root), os.path.join(root, "src"))
    _build(built, build, isa, missing or list(TOOLS), jobs)
    return built


def _build(built: LlamaCpp, build: str, isa: str, targets: list[str], jobs: int) -> None:
    """``targets`` built into ``build``: configured the first time; a cached build folder adds a tool without
    rebuilding the libraries it already holds."""
    configured = os.path.exists(os.path.join(build, "CMakeCache.txt"))
    took = "" if configured else "; ~10 min on 2 cores"
    print(f"building llama.cpp {built.version}'s {', '.join(targets)} for {isa} in {build}{took}")
    if not configured:
        _run(["cmake", "-S", built.source, "-B", build, *_cmake_options(isa)])
    _run(["nice", "-n", "10", "cmake", "--build", build, "-j", str(jobs), "--target", *targets])
    missing = [t for t in targets if not os.path.exists(built.tool(t))]
    if missing:
        raise BuildError(f"the llama.cpp build finished without {missing} in {built.bin_dir}")


def leaves_out_amx(isa: str) -> bool:
    """Whether the build for ``isa`` leaves AMX out: the native one on a CPU with AMX (see the module docstring)."""
    return isa == "native" and "amx_tile" in cpu_flags()


def _build_folder(isa: str) -> str:
    if isa != "native":
        return f"build-{isa}"
    return "build-noamx" if leaves_out_amx(isa) else "build"


def _cmake_options(isa: str) -> list[str]:
    no_amx = [f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}"]
    return [
        "-DCMAKE_BUILD_TYPE=Release",
        *_ISA_OPTIONS[isa],
        *(no_amx if leaves_out_amx(isa) else []),
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_SERVER=OFF",
        "-DBUILD_SHARED_LIBS=OFF",
    ]


def _check_toolchain() -> None:
    missing = [name for name in ("cmake",) if shutil.which(name) is None]
    if not any(shutil.which(cxx) for cxx in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (g++ or clang++)")
    if missing:
        raise BuildError(
            "building llama.cpp for this benchmark needs "
            + " and ".join(missing)
            + " on PATH (Debian/Ubuntu: apt-get install cmake g++); nothing was built"
        )


def _download(version: str, root: str) -> str:
    sdist = os.path.join(root, f"llama_cpp_python-{version}.tar.gz")
    if os.path.exists(sdist):
        return sdist
    print(f"fetching the llama-cpp-python {version} sdist (llama.cpp vendored) with pip")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    _run([*command, "-d", root, f"llama-cpp-python=={version}"])
    if not os.path.exists(sdist):
        raise BuildError(f"pip download did not leave {sdist}")
    return sdist


def _unpack(sdist: str, target: str) -> None:
    """The sdist's vendor/llama.cpp (sources, converter, gguf-py) into ``target``/vendor/llama.cpp."""
    prefix = os.path.basename(sdist).removesuffix(".tar.gz") + "/"
    partial = target + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            if member.name.startswith(prefix + "vendor/llama.cpp/"):
                member.name = member.name.removeprefix(prefix)
                members.append(member)
        tar.extractall(partial, members=members, filter="data")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, check=True, **kwargs)
    except FileNotFoundError as exc:
        raise BuildError(f"{command[0]} is not installed: {exc}") from None
    except subprocess.CalledProcessError as exc:
        raise BuildError(
            f"{' '.join(command[:4])} ... failed with status {exc.returncode}"
        ) from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--version", default=DEFAULT_VERSION, help="llama-cpp-python sdist version")
    parser.add_argument(
        "--isa", choices=ISAS, default="native", help="the instruction set to build for"
    )
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    try:
        built = ensure_llamacpp(args.version, args.jobs, args.isa)
    except BuildError as exc:
        raise SystemExit(f"llama.cpp: {exc}") from None
    amx = " without AMX" if leaves_out_amx(args.isa) else ""
    print(
        f"llama.cpp {built.version} ({args.isa}{amx}): {built.bin_dir} (converter {built.converter})"
    )


if __name__ == "__main__":
    main()
