"""Choosing the instruction set of the C++ CPU kernels (``SGLANG_CPU_ISA``): a value it does not know, or a forced
ISA this CPU cannot run, is an error naming what is wrong; each ISA has its own build folder; the start-up log
names the target; and the loaded kernels were compiled for the ISA this process asked for."""

from __future__ import annotations

import pytest
import torch

from sglang_lite import envs
from sglang_lite.kernels import cpu
from sglang_lite.kernels.cpu import build

AVX512_HOST = "flags\t\t: fpu sse sse2 avx fma f16c bmi1 bmi2 avx2 avx512f avx512dq avx512cd avx512bw avx512vl"
AVX512_BF16_HOST = AVX512_HOST + " avx512_bf16"
AVX2_HOST = "flags\t\t: fpu sse sse2 avx fma f16c bmi1 bmi2 avx2"
ARM_HOST = "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32"
OLD_HOST = "flags\t\t: fpu sse sse2"


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch):
    """Pretend to be a CPU with the given /proc/cpuinfo flags line and SGLANG_CPU_ISA (unset: native)."""

    def pretend(flags_line: str, chosen: str | None = None) -> None:
        monkeypatch.setattr(build, "_cpu_features", lambda: flags_line)
        if chosen is None:
            monkeypatch.delenv("SGLANG_CPU_ISA", raising=False)
        else:
            monkeypatch.setenv("SGLANG_CPU_ISA", chosen)

    return pretend


def _native_target(flags_line: str) -> str:
    """What ``-march=native`` compiles the kernels for on a CPU with these flags (common.h's choice of kIsa)."""
    flags = set(flags_line.partition(":")[2].split())
    if "avx512f" in flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "neon" if "asimd" in flags else "generic"


@pytest.mark.parametrize("value", ["sse4", "avx-512", "x86-64-v3"])
def test_an_unknown_isa_is_an_error_naming_the_variable(host, value):
    host(AVX512_HOST, value)
    with pytest.raises(ValueError, match=rf"SGLANG_CPU_ISA='{value}' must be one of"):
        cpu.isa()


@pytest.mark.parametrize("value", ["native", "avx2", "avx512", "AVX2"])
def test_a_known_isa_is_taken_in_any_case(host, value):
    host(AVX512_HOST, value)
    assert cpu.isa() == value.lower()


def test_forcing_avx512_on_an_avx2_cpu_names_what_it_lacks(host):
    host(AVX2_HOST, "avx512")
    with pytest.raises(ValueError) as raised:
        cpu.isa()
    message = str(raised.value)
    assert "SGLANG_CPU_ISA=avx512 (-march=x86-64-v4)" in message
    assert message.endswith("it lacks avx512f, avx512bw, avx512dq, avx512vl")


@pytest.mark.parametrize("flags_line", [OLD_HOST, ARM_HOST, AVX2_HOST.replace(" fma", "")])
def test_forcing_avx2_where_it_cannot_run_names_what_is_missing(host, flags_line):
    host(flags_line, "avx2")
    flags = set(flags_line.partition(":")[2].split())
    missing = [f for f in ("avx2", "fma", "f16c", "bmi2") if f not in flags]
    with pytest.raises(ValueError, match=f"it lacks {', '.join(missing)}$"):
        cpu.isa()


def test_a_cpu_without_a_flags_line_cannot_be_forced(host):
    """An unreadable /proc/cpuinfo proves nothing: a forced ISA is refused rather than built and crashed on."""
    host("", "avx2")
    with pytest.raises(ValueError, match="it lacks avx2, fma, f16c, bmi2"):
        cpu.isa()


def test_native_needs_no_flag(host):
    host(OLD_HOST)
    assert cpu.isa() == "native"


def test_a_forced_isa_the_cpu_lacks_raises_instead_of_falling_back(host, monkeypatch):
    """The references would run silently slower on another ISA than asked for: the first use says why instead."""
    host(AVX2_HOST, "avx512")
    monkeypatch.setattr(build, "_loaded", None)  # not tried yet in this pretend process
    monkeypatch.setattr(build, "_build_and_load", lambda: pytest.fail("must not build"))
    with pytest.raises(ValueError, match="lacks avx512f"):
        cpu.available()
    assert build._loaded is None


def test_each_isa_builds_into_its_own_folder(host, monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_CPU_KERNEL_CACHE", str(tmp_path))
    folders = {}
    for chosen in ("native", "avx2", "avx512"):
        host(AVX512_BF16_HOST, chosen)
        folders[chosen] = cpu.build_directory()
        assert folders[chosen] == cpu.build_directory()  # the same ISA finds its build again
        assert folders[chosen].startswith(str(tmp_path))
    assert len(set(folders.values())) == 3


def test_a_forced_isa_has_no_folder_where_it_cannot_run(host, monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_CPU_KERNEL_CACHE", str(tmp_path))
    host(AVX2_HOST, "avx512")
    with pytest.raises(ValueError, match="lacks avx512f"):
        cpu.build_directory()


@pytest.mark.parametrize(
    "chosen, text",
    [
        ("avx2", "avx2 (-march=x86-64-v3, SGLANG_CPU_ISA)"),
        ("avx512", "avx512 (-march=x86-64-v4, SGLANG_CPU_ISA)"),
    ],
)
def test_describe_a_forced_isa(host, chosen, text):
    host(AVX512_BF16_HOST, chosen)
    assert cpu.describe_isa() == text


@pytest.mark.parametrize(
    "flags_line, reached",
    [
        (AVX512_BF16_HOST, "avx512_bf16"),
        (AVX512_HOST, "avx512f"),
        (AVX2_HOST, "avx2"),
        (ARM_HOST, "asimd"),
        (OLD_HOST, "no vector extension known to the kernels"),
    ],
)
def test_describe_native_names_the_widest_extension_reached(host, flags_line, reached):
    host(flags_line)
    assert cpu.describe_isa() == f"native (-march=native: {reached})"


def test_the_loaded_kernels_are_built_for_the_isa_asked():
    """In this process, whatever SGLANG_CPU_ISA it started with (the AVX2 pass of test_cpu_avx2_pass.py runs this
    file under avx2): native is this CPU's widest target, a forced ISA exactly that one."""
    cpu.require()
    asked = envs.SGLANG_CPU_ISA.get()
    want = _native_target(build._cpu_features()) if asked == "native" else asked
    assert torch.ops.sglang_lite_cpu.isa() == want
