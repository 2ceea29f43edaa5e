"""Building and loading the C++ CPU kernels (``kernels/cpu/csrc``): compiled with torch's ``cpp_extension`` on first
use into a cache folder named by the sources, flags, torch installation and CPU, and loaded from there afterwards
(``kernels/cpu/__init__.py`` says why and how)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading

import torch

from sglang_lite import envs
from sglang_lite.envs import torch_isa_env  # noqa: F401 - the package's build interface

logger = logging.getLogger(__name__)

_SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_COMPILED = (
    "decode_ops.cpp",
    "linear_ops.cpp",
    "layer_ops.cpp",
    "moe_ops.cpp",
    "prefill_ops.cpp",
)  # the rest of csrc/ (headers) is included by these
_LIBRARY = "sglang_lite_cpu_ops"
# -fopenmp: at::parallel_for's OpenMP region is inlined from the headers; the library it links (libgomp.so.1) is
# the one torch has already loaded, so both share torch's thread pool. -fno-trapping-math: the kernels read no
# floating-point exception flags, and without it GCC cannot vectorise a loop whose exp (common.h's vexp) it has
# split into branches on an ISA without masked vector operations: SiLU and sigmoid loops ran scalar on AVX2 (the
# conv1d's SiLU 8x slower than vectorised). It changes no value: every operation is done as written, in order.
_CFLAGS = ["-O3", "-fopenmp", "-fno-trapping-math"]
_LDFLAGS = ["-fopenmp"]
# What SGLANG_CPU_ISA can force instead of this CPU's own (native): the -march of the build and the /proc/cpuinfo
# flags a host needs to run it. avx2 is x86-64-v3 (AVX2, FMA, F16C, BMI2; 16 vector registers of 256 bits), avx512
# x86-64-v4 (AVX-512 F/BW/DQ/VL/CD; 32 of 512 bits, without BF16 or VNNI), so that an AVX-512 host builds, tests
# and measures what an AVX2-only CPU runs. The kernels choose their register tiles from the target's macros.
ISA_TARGETS = {
    "avx2": ("x86-64-v3", ("avx2", "fma", "f16c", "bmi2")),
    "avx512": (
        "x86-64-v4",
        ("avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512dq", "avx512vl"),
    ),
}

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet
_error = ""


def isa() -> str:
    """The instruction set the kernels are built for: SGLANG_CPU_ISA (native, avx2 or avx512). A forced one this
    CPU cannot run is a ValueError that names what the CPU lacks."""
    chosen = envs.SGLANG_CPU_ISA.get()
    if chosen == "native":
        return chosen
    march, needed = ISA_TARGETS[chosen]
    flags = cpu_flags()
    missing = [f for f in needed if f not in flags]
    if missing:
        raise ValueError(
            f"SGLANG_CPU_ISA={chosen} (-march={march}) cannot run on this CPU: it lacks {', '.join(missing)}"
        )
    return chosen


def describe_isa() -> str:
    """What the start-up log says of the target: the ISA, its -march, and the vector extensions it reaches."""
    chosen = isa()
    if chosen != "native":
        return f"{chosen} (-march={ISA_TARGETS[chosen][0]}, SGLANG_CPU_ISA)"
    flags = cpu_flags()
    reached = [name for name in ("avx512_bf16", "avx512f", "avx2", "asimd") if name in flags]
    return f"native (-march=native: {reached[0] if reached else 'no vector extension known to the kernels'})"


def _march_flags() -> list[str]:
    chosen = isa()
    return ["-march=native"] if chosen == "native" else [f"-march={ISA_TARGETS[chosen][0]}"]


def available() -> bool:
    """True when the kernels are built and loaded (building them on the first call). A forced ISA this CPU cannot
    run raises (``isa``) instead of falling back: the run asked for something it cannot have."""
    global _loaded, _error
    if _loaded is not None:  # asked before every op: no lock once decided
        return _loaded
    isa()
    with _lock:
        if _loaded is None:
            try:
                _build_and_load()
                _loaded = True
            except Exception as exc:  # noqa: BLE001 - any build failure means: run the references
                _loaded, _error = False, f"{type(exc).__name__}: {exc}"
                logger.warning(
                    "fused CPU kernels unavailable, the CPU runs the PyTorch references: %s", _error
                )
        return _loaded


def prepare() -> str:
    """Build (or load) the kernels now unless a run forces another backend, so that an engine starting on the CPU
    pays the first build at start rather than in its first request; says which path float32 models will take."""
    if envs.SGLANG_KERNEL_BACKEND.get() in ("torch", "triton"):
        return f"off (SGLANG_KERNEL_BACKEND={envs.SGLANG_KERNEL_BACKEND.get()})"
    return (
        f"on, built for {describe_isa()}"
        if available()
        else f"off, the PyTorch references run ({_error})"
    )


def enabled() -> bool:
    """Whether this run takes the kernels: they build (now, if not yet) and no other backend is forced."""
    return envs.SGLANG_KERNEL_BACKEND.get() not in ("torch", "triton") and available()


def loaded() -> bool:
    """Whether the kernels are loaded already (never builds)."""
    return bool(_loaded)


def require() -> None:
    """Raise, with the build's reason, when the kernels cannot be built (``SGLANG_KERNEL_BACKEND=native``)."""
    if not available():
        raise RuntimeError(f"the fused CPU kernels (kernels/cpu) could not be built: {_error}")


def _build_and_load() -> None:
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    build_dir = build_directory()
    sources = stage_sources(build_dir)
    if not os.path.exists(os.path.join(build_dir, _LIBRARY + ".so")):
        logger.warning(
            "building the C++ CPU kernels for %s (once, ~30-60 s) into %s",
            describe_isa(),
            build_dir,
        )
    cpp_extension.load(
        name=_LIBRARY,
        sources=sources,
        build_directory=build_dir,
        extra_cflags=_CFLAGS + _march_flags(),
        extra_ldflags=list(_LDFLAGS),  # a copy: cpp_extension appends to the list it is given
        is_python_module=False,
        verbose=False,
    )
    from .. import batch_invariant  # the process's switch, set before the kernels loaded

    torch.ops.sglang_lite_cpu.set_batch_invariant(batch_invariant.enabled())


def build_directory(source_dir: str = _SOURCE_DIR) -> str:
    """The cache folder of the build of ``source_dir``'s sources: named by their content, never by their path."""
    return os.path.join(_cache_root(), _build_key(source_dir))


def stage_sources(build_dir: str, source_dir: str = _SOURCE_DIR) -> list[str]:
    """Copy the sources into ``build_dir/src`` (once: an unchanged file keeps its mtime, so ninja does not rebuild)
    and return the paths to compile, which lie in the cache whatever checkout they came from."""
    staged = os.path.join(build_dir, "src")
    os.makedirs(staged, exist_ok=True)
    for name in sorted(os.listdir(source_dir)):
        target = os.path.join(staged, name)
        if not os.path.exists(
            target
        ):  # the folder's name is the content's hash: a file there is this one
            partial = f"{target}.{os.getpid()}.tmp"
            shutil.copyfile(os.path.join(source_dir, name), partial)
            os.replace(partial, target)  # atomic: a concurrent build sees the whole file or none
    return [os.path.join(staged, name) for name in _COMPILED]


def _cache_root() -> str:
    configured = envs.SGLANG_CPU_KERNEL_CACHE.get()
    return configured or os.path.join(
        os.path.expanduser("~"), ".cache", "sglang_lite", "cpu_kernels"
    )


def _build_key(source_dir: str) -> str:
    """Sources (headers included, by name and content), flags, the torch installation (its headers and libraries
    are on the build's command line) and the CPU's features: a build made for another machine, another torch or
    from other sources is never loaded."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(source_dir)):
        with open(os.path.join(source_dir, name), "rb") as f:
            digest.update(name.encode() + f.read())
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    digest.update(
        " ".join(
            _CFLAGS + _march_flags() + _LDFLAGS + [torch.__version__, torch_dir, sys.version]
        ).encode()
    )
    digest.update(_cpu_features().encode())
    return digest.hexdigest()[:16]


def cpu_flags() -> set[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them (x86 ``flags``, aarch64 ``Features``); empty where it
    cannot be read."""
    return set(_cpu_features().partition(":")[2].split())


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _put_ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH; pip's copy (a dependency) sits beside this Python, which a virtual
    environment run without activation does not have on PATH."""
    beside = os.path.dirname(sys.executable)
    if not shutil.which("ninja") and shutil.which("ninja", path=beside):
        os.environ["PATH"] = beside + os.pathsep + os.environ.get("PATH", "")
