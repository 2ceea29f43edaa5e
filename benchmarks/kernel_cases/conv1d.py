"""Benchmark and GPU-check cases for the causal conv1d kernels (prefill over packed requests, decode)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_lite.kernels import conv1d
from sglang_lite.kernels.conv1d import naive

from ._compare import check_row
from ._timing import time_ms

K = 4


def _cu(lens: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)


def check(device: torch.device) -> list[dict]:
    rows = []
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        lens, dim = [1, 63, 300, 65], 1000
        x = torch.randn(sum(lens), dim, device=device, dtype=dtype)
        w = torch.randn(dim, K, device=device, dtype=dtype)
        pool = torch.randn(8, dim, K - 1, device=device, dtype=dtype)
        slots = torch.tensor([5, 1, 7, 2], device=device)
        got_pool, want_pool = pool.clone(), pool.clone()
        got = conv1d.causal_conv1d_fn(x, w, got_pool, slots, _cu(lens, device), backend="triton")
        want = naive.causal_conv1d_fn(x, w, want_pool, slots, _cu(lens, device))
        rows.append(check_row(f"causal_conv1d_fn {dtype}", got, want, tol))
        rows.append(check_row(f"conv state {dtype}", got_pool, want_pool, tol))
        xd = torch.randn(4, dim, device=device, dtype=dtype)
        got = conv1d.causal_conv1d_update(xd, w, got_pool, slots, backend="triton")
        want = naive.causal_conv1d_update(xd, w, want_pool, slots)
        rows += [
            check_row(f"causal_conv1d_update {dtype}", got, want, tol),
            check_row(f"conv state after decode {dtype}", got_pool, want_pool, tol),
        ]
    return rows


def bench(device: torch.device, quick: bool) -> list[dict]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dim = 2 * 16 * 128 + 32 * 128  # conv_dim of a Qwen3.5 linear layer (HK=16, HV=32, d=128)
    tokens, batch = (2048 if quick or device.type != "cuda" else 8192), 64
    x = torch.randn(tokens, dim, device=device, dtype=dtype)
    w = torch.randn(dim, K, device=device, dtype=dtype)
    pool = torch.zeros(batch + 1, dim, K - 1, device=device, dtype=dtype)
    one, slots = torch.tensor([1], device=device), torch.arange(1, batch + 1, device=device)
    xd = torch.randn(batch, dim, device=device, dtype=dtype)
    w3 = w.unsqueeze(1)
    size, iters = x.element_size(), 20 if device.type == "cuda" else 5

    def t(fn):
        return time_ms(fn, device, iters=iters, warmup=2)

    def hf_prefill():  # HF's no-cache path: nn.Conv1d with left padding, then SiLU
        return F.silu(F.conv1d(x.t().unsqueeze(0), w3, padding=K - 1, groups=dim)[..., :tokens])

    def hf_decode():  # HF's torch_causal_conv1d_update: roll the state, multiply-add, SiLU
        window = torch.cat([pool[slots], xd.unsqueeze(-1)], -1)
        pool[slots] = window[..., 1:]
        return F.silu((window * w).sum(-1))

    return [
        {
            "kernel": "causal_conv1d_fn",
            "shape": f"T={tokens} D={dim}",
            "ours_ms": t(lambda: conv1d.causal_conv1d_fn(x, w, pool, one, _cu([tokens], device))),
            "ref_name": "F.conv1d + silu (HF no-cache)",
            "ref_ms": t(hf_prefill),
            "bytes": 2 * x.numel() * size,
        },
        {
            "kernel": "causal_conv1d_update",
            "shape": f"B={batch} D={dim}",
            "ours_ms": t(lambda: conv1d.causal_conv1d_update(xd, w, pool, slots)),
            "ref_name": "gather/cat/sum (HF update)",
            "ref_ms": t(hf_decode),
            "bytes": (2 * xd.numel() + 2 * batch * dim * (K - 1)) * size,
        },
    ]
