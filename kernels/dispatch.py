"""Choose between the Triton kernel and the plain-PyTorch reference for one call.

Triton runs on a GPU (CUDA or ROCm). On the CPU the PyTorch reference is the fast path, unless Triton is asked for
explicitly, which together with ``TRITON_INTERPRET=1`` is how the tests run the Triton kernels without a GPU.
The environment variable ``SGLANG_KERNEL_BACKEND`` (``auto`` | ``triton`` | ``torch``) forces one side for a run;
the ``backend`` argument of each public kernel function forces it for a call and wins over the variable.
"""
from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "torch")


def _requested(backend: str | None) -> str:
    choice = backend if backend is not None else os.environ.get("SGLANG_KERNEL_BACKEND", "auto")
    choice = choice.strip().lower()
    if choice not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {choice!r} (argument or SGLANG_KERNEL_BACKEND)")
    return choice


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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
