"""Choose between the Triton kernel, the fused C++ CPU kernel and the plain-PyTorch reference for one call.

Triton runs on a GPU (CUDA or ROCm). On the CPU, float32 data take the fused C++ kernels of ``kernels/cpu`` where a
family has one and they build, and the PyTorch reference otherwise. The C++ kernels serve prefill as well as
decode: the norms, the GDN gating, the MoE routing, linear layers of up to ``cpu.LINEAR_MAX_ROWS`` rows, the fused
MoE (a prefill's tokens in chunks of ``cpu.MOE_CHUNK_TOKENS``) and the greedy argmax in both; the gated delta rule
of prefill (``chunk_gated_delta_rule``) and the packed causal conv1d; the conv update, the recurrent gated delta
rule and paged attention in decode. Extend attention, the KV store, rotary, the plain top-k softmax and the FP8 ops
have none. Triton runs on the CPU only when asked for explicitly, which together with ``TRITON_INTERPRET=1`` is how
the tests run the Triton kernels without a GPU. The environment variable ``SGLANG_KERNEL_BACKEND`` (``auto`` |
``triton`` | ``torch`` | ``native``) forces one side for a run (``torch``: the references only; ``native``: the C++
kernels, an error when they cannot be built); the ``backend`` argument of each public kernel function forces it for
a call and wins over the variable.
"""

from __future__ import annotations

import functools
import os

import torch

from sglang_lite import envs

from . import batch_invariant, cpu

BACKENDS = envs.SGLANG_KERNEL_BACKEND.choices


def _requested(backend: str | None) -> str:
    if backend is None:  # every kernel call of a forward asks: the unset variable is the quick case
        return (
            envs.SGLANG_KERNEL_BACKEND.get()
            if envs.SGLANG_KERNEL_BACKEND.name in os.environ
            else "auto"
        )
    choice = backend.strip().lower()
    if choice not in BACKENDS:
        raise ValueError(f"kernel backend argument must be one of {BACKENDS}, got {backend!r}")
    return choice


def triton_interpreting() -> bool:
    return bool(envs.TRITON_INTERPRET.get())


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` for a ``tl.dot`` whose operands hold ``dtype`` data (the kernel may have widened them).

    float32 data keeps float32 accuracy (about 1e-6 relative): Triton's default, tf32, rounds operands to 10
    mantissa bits (about 1e-3 per product). NVIDIA emulates "ieee" and takes minutes to compile it at 64-wide
    tiles, so CUDA uses three tf32 products (hi*hi + hi*lo + lo*hi) on the tensor cores; AMD's matrix cores
    multiply float32 natively ("ieee"). 16-bit data need no more than tf32, which AMD offers on gfx942 (MI300) only.
    """
    if torch.version.hip:
        tf32_ok = dtype != torch.float32 and _hip_arch().startswith("gfx942")
        return "tf32" if tf32_ok else "ieee"
    return "tf32x3" if dtype == torch.float32 else "tf32"


def gpu_arch() -> str:
    """The GPU a launch targets, for launch parameters chosen per target: ``"cuda"`` on NVIDIA, the gfx name on
    ROCm (``gcnArchName`` without its feature flags: ``"gfx942"``, ``"gfx950"``)."""
    return _hip_arch().split(":")[0] if torch.version.hip else "cuda"


@functools.lru_cache(maxsize=None)
def _hip_arch() -> str:
    if not torch.cuda.is_available():
        return ""
    return torch.cuda.get_device_properties(torch.cuda.current_device()).gcnArchName


def use_triton(tensor: torch.Tensor, backend: str | None = None) -> bool:
    """True when this call should run the Triton kernel for data living on ``tensor.device``."""
    choice = _requested(backend)
    if choice == "torch":
        return False
    if choice == "triton":
        if tensor.device.type == "cpu" and not triton_interpreting():
            raise RuntimeError("the Triton backend on CPU tensors needs TRITON_INTERPRET=1")
        return True
    return tensor.device.type == "cuda"  # torch.cuda covers ROCm (HIP) devices too


def use_native(*tensors: torch.Tensor, backend: str | None = None) -> bool:
    """True when this call should run the fused C++ CPU kernel: every tensor float32 on the CPU, outside
    torch.compile's tracing (it fuses the references itself), the kernels built, and no other backend forced."""
    for t in tensors:  # the cheap checks first: this runs for every kernel call of a forward
        if not t.is_cpu or t.dtype is not torch.float32:
            return False
    choice = _requested(backend)
    if choice in ("torch", "triton") or torch.compiler.is_compiling():
        return False
    if choice == "native":
        cpu.require()
        return True
    return cpu.available()


def as_decode_blocks(*tensors: torch.Tensor) -> bool:
    """True when a module should take the decode blocks' own C++ step for an elementwise part (rotary, the gates,
    silu * up): batch invariance on the CPU, where a prompt token must compute what a decode token does."""
    return batch_invariant.enabled() and use_native(*tensors)
