"""Environment flags of sglang_lite: typed, parsed one way everywhere, read when used (never at import).

Booleans accept true/1/yes and false/0/no (any case); an empty variable counts as unset; anything else raises a
ValueError naming the variable. This module imports nothing heavy so the router can use it too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

TRUE_WORDS = ("true", "1", "yes")
FALSE_WORDS = ("false", "0", "no")


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    return None if value is None or value.strip() == "" else value.strip()


@dataclass(frozen=True)
class EnvBool:
    name: str
    default: bool | None  # None: "not set", the caller picks a platform default
    help: str

    def get(self) -> bool | None:
        value = _raw(self.name)
        if value is None:
            return self.default
        if value.lower() in TRUE_WORDS:
            return True
        if value.lower() in FALSE_WORDS:
            return False
        raise ValueError(
            f"environment variable {self.name}={value!r} is not a boolean (use one of "
            f"{TRUE_WORDS + FALSE_WORDS})"
        )


@dataclass(frozen=True)
class EnvInt:
    name: str
    default: int
    help: str

    def get(self) -> int:
        value = _raw(self.name)
        if value is None:
            return self.default
        try:
            return int(value)
        except ValueError:
            raise ValueError(
                f"environment variable {self.name}={value!r} is not an integer"
            ) from None


@dataclass(frozen=True)
class EnvChoice:
    name: str
    default: str
    choices: tuple[str, ...]
    help: str

    def get(self) -> str:
        value = _raw(self.name)
        if value is None:
            return self.default
        if value.lower() not in self.choices:
            raise ValueError(
                f"environment variable {self.name}={value!r} must be one of {self.choices}"
            )
        return value.lower()


@dataclass(frozen=True)
class EnvStr:
    name: str
    default: str
    help: str

    def get(self) -> str:
        value = _raw(self.name)
        return self.default if value is None else value


SGLANG_ALT_STREAM = EnvBool(
    "SGLANG_ALT_STREAM",
    False,
    "Create the alternate stream on ROCm (CUDA always has it; the CPU never).",
)
SGLANG_GDN_QKVZ_BA_ALT_STREAM = EnvBool(
    "SGLANG_GDN_QKVZ_BA_ALT_STREAM",
    False,
    "ROCm: overlap the GDN in_proj_qkvz and in_proj_ba GEMMs (CUDA always does, as upstream).",
)
SGLANG_QK_NORM_ALT_STREAM = EnvBool(
    "SGLANG_QK_NORM_ALT_STREAM",
    None,
    "ROCm: overlap q_norm and k_norm (CUDA always does, as upstream).",
)
SGLANG_ALT_STREAM_EAGER = EnvBool(
    "SGLANG_ALT_STREAM_EAGER",
    False,
    "Also overlap outside CUDA-graph capture (upstream overlaps only in capture).",
)
SGLANG_GDN_ALT_STREAM_MAX_TOKENS = EnvInt(
    "SGLANG_GDN_ALT_STREAM_MAX_TOKENS",
    1024,
    "GDN projections overlap only for batches under this many tokens.",
)
SGLANG_KERNEL_BACKEND = EnvChoice(
    "SGLANG_KERNEL_BACKEND",
    "auto",
    ("auto", "triton", "torch", "native"),
    "Force Triton, PyTorch or the fused C++ CPU kernels (kernels/dispatch.py).",
)
SGLANG_CPU_KERNEL_CACHE = EnvStr(
    "SGLANG_CPU_KERNEL_CACHE",
    "",
    "Where the fused C++ CPU kernels are built (default ~/.cache/sglang_lite/cpu_kernels).",
)
SGLANG_CPU_ISA = EnvChoice(
    "SGLANG_CPU_ISA",
    "native",
    ("native", "avx2", "avx512"),
    "The instruction set the C++ CPU kernels are built for (a build cached per ISA): native (this CPU's, "
    "-march=native), avx2 (x86-64-v3: AVX2, FMA, F16C, BMI2, no AVX-512) or avx512 (x86-64-v4, without BF16 "
    "or VNNI). One this CPU cannot run is an error.",
)
# PyTorch's own CPU kernels (ATen's vectorised ops, oneDNN, MKL) on a forced ISA: read when torch is imported, so a
# process must have them in its environment before it starts. The benchmarks set them for a forced ISA, so that an
# AVX-512 host measures both sides of a comparison on AVX2.
_TORCH_ISA_ENV = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
    "avx512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
}


def torch_isa_env(isa: str) -> dict[str, str]:
    """The environment that puts PyTorch's own CPU kernels on ``isa`` (SGLANG_CPU_ISA's values; none for native)."""
    return dict(_TORCH_ISA_ENV.get(isa, {}))


SGLANG_CPU_BF16_DOT = EnvChoice(
    "SGLANG_CPU_BF16_DOT",
    "auto",
    ("auto", "widen", "dot"),
    "bf16 weights in the C++ CPU kernels: auto widens products of up to 8 rows (bound by reading the weights) and "
    "takes AVX512-BF16's vdpbf16ps (activations rounded to bf16) for more rows where the CPU has it and runs it at "
    "the float32 FMA's products a second or more (measured once per process); widen widens every weight to "
    "float32 in registers, float32 activations (the path of CPUs without it); dot takes vdpbf16ps at every row "
    "count.",
)
SGLANG_CPU_GREEDY_HEAD = EnvBool(
    "SGLANG_CPU_GREEDY_HEAD",
    True,
    "Greedy decode at batch 1 on the CPU (the one-call decode loop) finds each token through an int8 copy of a "
    "float32 or bf16 LM head, built on first use (V x H bytes), and the exact logits of the few rows that can be "
    "the maximum: the tokens of the whole head, bitwise, reading about half of a bf16 head (kernels/cpu/csrc/"
    "greedy_head.h). false: every step reads the whole head.",
)
SGLANG_CPU_BF16_PLANES = EnvBool(
    "SGLANG_CPU_BF16_PLANES",
    None,
    "The one-call CPU decode keeps a second copy of each bf16 Gated DeltaNet projection in 12 bits a weight, "
    "without loss (a table of each weight row's high bytes and a 4-bit index a weight; kernels/cpu/csrc/"
    "bf16_planes.h), and a step at batch 1 reads it instead of the bf16 weight: the same values, ~0.75x the bytes. "
    "It costs ~0.75x those weights' bytes of memory. Unset: where the kernels' build decodes them faster than it "
    "reads bf16 (AVX-512); true: on every CPU; false: none.",
)
TRITON_INTERPRET = EnvBool(
    "TRITON_INTERPRET",
    False,
    "Triton's own flag: run Triton kernels on the CPU in its interpreter (as the tests do).",
)
SGLANG_ROUTER_P2C_LOAD_METRIC = EnvStr(
    "SGLANG_ROUTER_P2C_LOAD_METRIC",
    "tokens",
    "Load metric of the router's power_of_two policy; as upstream, an unknown value means tokens (the flag wins).",
)

ALL = [v for v in list(globals().values()) if isinstance(v, (EnvBool, EnvInt, EnvChoice, EnvStr))]
