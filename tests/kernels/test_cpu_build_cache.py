"""The C++ CPU kernels' build cache is keyed by the sources' content, never by the checkout's path: two copies of
the same sources map to one build folder, and the files the build compiles lie in that folder."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from sglang_lite.kernels import cpu

SOURCE_DIR = Path(cpu.__file__).parent / "csrc"


@pytest.fixture()
def two_checkouts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    monkeypatch.setenv("SGLANG_CPU_KERNEL_CACHE", str(tmp_path / "cache"))
    first, second = tmp_path / "a" / "kernels" / "cpu" / "csrc", tmp_path / "b" / "csrc"
    shutil.copytree(SOURCE_DIR, first)
    shutil.copytree(SOURCE_DIR, second)
    return first, second


def test_two_copies_of_the_sources_share_one_build_folder(two_checkouts):
    first, second = two_checkouts
    build_dir = cpu.build_directory(str(first))
    assert build_dir == cpu.build_directory(str(second))
    assert str(first) not in build_dir and str(second) not in build_dir


def test_changed_sources_get_another_build_folder(two_checkouts):
    first, second = two_checkouts
    with open(second / "common.h", "a") as f:
        f.write("\n// changed\n")
    assert cpu.build_directory(str(first)) != cpu.build_directory(str(second))


def test_the_build_compiles_copies_inside_its_folder(two_checkouts):
    first, second = two_checkouts
    build_dir = cpu.build_directory(str(first))
    sources = cpu.stage_sources(build_dir, str(first))
    assert sources == cpu.stage_sources(
        build_dir, str(second)
    )  # the second checkout reuses the copies
    for path in sources:
        assert path.startswith(build_dir + os.sep)
        assert Path(path).read_bytes() == (first / Path(path).name).read_bytes()
    assert (
        Path(build_dir) / "src" / "common.h"
    ).exists()  # the header the sources include sits beside them


def test_staging_again_leaves_the_copies_untouched(two_checkouts):
    """ninja rebuilds a file whose mtime moved: a second start must not rewrite the copies."""
    first, _ = two_checkouts
    build_dir = cpu.build_directory(str(first))
    sources = cpu.stage_sources(build_dir, str(first))
    before = [os.stat(p).st_mtime_ns for p in sources]
    cpu.stage_sources(build_dir, str(first))
    assert [os.stat(p).st_mtime_ns for p in sources] == before


def test_a_build_says_so_once_with_its_folder(tmp_path, monkeypatch, caplog):
    """The first start on a machine pays the compile; it names it instead of looking hung. cpp_extension is
    replaced here: what is checked is the message and the sources handed to it, not the compiler."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("SGLANG_CPU_KERNEL_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw))
    with caplog.at_level(logging.WARNING, logger=cpu.__name__):
        cpu._build_and_load()
        build_dir = calls[0]["build_directory"]
        Path(build_dir, "sglang_lite_cpu_ops.so").write_bytes(b"")  # what a finished build leaves
        cpu._build_and_load()
    said = [
        r.getMessage() for r in caplog.records if "building the C++ CPU kernels" in r.getMessage()
    ]
    assert len(said) == 1 and build_dir in said[0]
    assert all(path.startswith(build_dir + os.sep) for path in calls[0]["sources"])
