"""The C++ CPU kernels compile for aarch64 (NEON) as well as for this x86 host: each ``kernels/cpu/csrc/*.cpp`` is
compiled, not linked, by the cross compiler against torch's headers with the flags torch's ``cpp_extension`` gives
the build, so that code written for one ISA's intrinsics without a portable fallback fails here rather than on an
ARM machine. Skipped where ``aarch64-linux-gnu-g++`` is not installed (``.ci/run`` installs it)."""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from sglang_lite.kernels.cpu import build

CROSS_COMPILER = "aarch64-linux-gnu-g++"
SOURCES = sorted(Path(build._SOURCE_DIR).glob("*.cpp"))
TIMEOUT_S = 600  # a hung compiler fails its file instead of the CI job


def _command(source: Path, output_dir: Path) -> list[str]:
    """cpp_extension's compile line for the library (its standard, defines and torch's headers) for the cross
    compiler's default target, armv8-a with NEON. At -O0: the front end does every check this test is for (the
    intrinsics, their constant lane arguments, the templates each ISA instantiates), and the five sources take 61 s
    of compiler time there against 88 s at -O2 on a Zen 3 core (most of it torch's headers either way)."""
    includes = [flag for path in cpp_extension.include_paths() for flag in ("-isystem", path)]
    defines = [
        f"-DTORCH_EXTENSION_NAME={build._LIBRARY}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
    ]
    output = output_dir / f"{source.stem}.o"
    flags = ["-std=c++20", "-fPIC", "-O0", "-fopenmp"]
    return [CROSS_COMPILER, *flags, *defines, *includes, "-c", "-o", str(output), str(source)]


def _compile(source: Path, output_dir: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            _command(source, output_dir),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess([], returncode=-1, stdout=f"over {TIMEOUT_S} s")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    """Every source compiled once, as many at a time as there are cores: source name -> the compiler's result."""
    if shutil.which(CROSS_COMPILER) is None:
        pytest.skip(f"{CROSS_COMPILER} is not on PATH (apt-get install g++-aarch64-linux-gnu)")
    output_dir = tmp_path_factory.mktemp("aarch64")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = pool.map(lambda source: _compile(source, output_dir), SOURCES)
        return {source.name: result for source, result in zip(SOURCES, results)}


def test_every_source_is_checked():
    assert {source.name for source in SOURCES} >= set(build._COMPILED)


@pytest.mark.parametrize("name", [source.name for source in SOURCES])
def test_source_compiles_for_aarch64(compiled, name):
    result = compiled[name]
    assert result.returncode == 0, f"{CROSS_COMPILER} failed on {name}:\n{result.stdout[-6000:]}"
