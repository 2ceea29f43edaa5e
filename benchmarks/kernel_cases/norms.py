"""Benchmark and GPU-check cases for the RMSNorm family (Gemma RMSNorm, fused q/k norm, gated RMSNorm)."""

from __future__ import annotations

import torch
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Qwen3_5MoeRMSNorm,
    Qwen3_5MoeRMSNormGated,
)

from sglang_lite.kernels import norms
from sglang_lite.kernels.norms import naive

from ._compare import check_row
from ._timing import time_ms

EPS = 1e-6


def check(device: torch.device) -> list[dict]:
    rows = []
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        x = torch.randn(300, 2048, device=device, dtype=dtype)
        w, r = torch.randn(2048, device=device, dtype=dtype), torch.randn_like(x)
        rows.append(
            check_row(
                f"gemma_rmsnorm {dtype}",
                norms.gemma_rmsnorm(x, w, EPS, backend="triton"),
                naive.gemma_rmsnorm(x, w, EPS),
                tol,
            )
        )
        got, want = (
            norms.gemma_rmsnorm(x, w, EPS, r, backend="triton"),
            naive.gemma_rmsnorm(x, w, EPS, r),
        )
        rows.append(check_row(f"gemma_rmsnorm+residual {dtype}", got[0], want[0], tol))
        # q, k are slices of one projection
        proj = torch.randn(65, (16 + 2 * 2) * 256, device=device, dtype=dtype)
        q, k = proj[:, : 16 * 256], proj[:, 16 * 256 : 18 * 256]
        qw, kw = w[:256].contiguous(), w[256:512].contiguous()
        got = norms.fused_qk_gemma_rmsnorm(q, k, qw, kw, EPS, 256, backend="triton")
        want = naive.fused_qk_gemma_rmsnorm(q, k, qw, kw, EPS, 256)
        rows += [
            check_row(f"fused_qk_gemma_rmsnorm {n} {dtype}", a, b, tol)
            for n, a, b in zip("qk", got, want)
        ]
        o = torch.randn(65, 32, 128, device=device, dtype=dtype)
        z = torch.randn(65, 32, 128, device=device, dtype=dtype)
        w_head = w[:128].contiguous()
        rows.append(
            check_row(
                f"gated_rmsnorm {dtype}",
                norms.gated_rmsnorm(o, z, w_head, EPS, backend="triton"),
                naive.gated_rmsnorm(o, z, w_head, EPS),
                tol,
            )
        )
    return rows


def bench(device: torch.device, quick: bool) -> list[dict]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = 2048 if quick or device.type != "cuda" else 8192
    hidden, heads, kv_heads, head_dim, v_heads, dv = 4096, 32, 4, 256, 64, 128
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    w, r = torch.randn(hidden, device=device, dtype=dtype), torch.randn_like(x)
    hf = Qwen3_5MoeRMSNorm(hidden, eps=EPS).to(device)
    hf_gated = Qwen3_5MoeRMSNormGated(dv, eps=EPS).to(device, dtype)
    q = torch.randn(tokens, heads * head_dim, device=device, dtype=dtype)
    k = torch.randn(tokens, kv_heads * head_dim, device=device, dtype=dtype)
    qw, kw = w[:head_dim].contiguous(), w[head_dim : 2 * head_dim].contiguous()
    hf_q, hf_k = (
        Qwen3_5MoeRMSNorm(head_dim, eps=EPS).to(device),
        Qwen3_5MoeRMSNorm(head_dim, eps=EPS).to(device),
    )
    o, z = (torch.randn(tokens, v_heads, dv, device=device, dtype=dtype) for _ in range(2))
    gw = torch.ones(dv, device=device, dtype=dtype)
    size, iters = x.element_size(), 20 if device.type == "cuda" else 5

    def t(fn):
        return time_ms(fn, device, iters=iters, warmup=2)

    with torch.no_grad():
        return [
            {
                "kernel": "gemma_rmsnorm",
                "shape": f"[{tokens}, {hidden}]",
                "ours_ms": t(lambda: norms.gemma_rmsnorm(x, w, EPS)),
                "ref_name": "HF Qwen3_5MoeRMSNorm",
                "ref_ms": t(lambda: hf(x)),
                "bytes": 2 * x.numel() * size,
            },
            {
                "kernel": "gemma_rmsnorm+residual",
                "shape": f"[{tokens}, {hidden}]",
                "ours_ms": t(lambda: norms.gemma_rmsnorm(x, w, EPS, r)),
                "ref_name": "add + HF Qwen3_5MoeRMSNorm",
                "ref_ms": t(lambda: hf(x + r)),
                "bytes": 4 * x.numel() * size,
            },
            {
                "kernel": "fused_qk_gemma_rmsnorm",
                "shape": f"q[{tokens}, {heads}x{head_dim}] k[{kv_heads}x{head_dim}]",
                "ours_ms": t(lambda: norms.fused_qk_gemma_rmsnorm(q, k, qw, kw, EPS, head_dim)),
                "ref_name": "2 x gemma_rmsnorm (ours)",
                "ref_ms": t(
                    lambda: (
                        norms.gemma_rmsnorm(q.view(-1, head_dim), qw, EPS),
                        norms.gemma_rmsnorm(k.view(-1, head_dim), kw, EPS),
                    )
                ),
                "bytes": 2 * (q.numel() + k.numel()) * size,
            },
            {
                "kernel": "fused_qk_gemma_rmsnorm",
                "shape": f"q[{tokens}, {heads}x{head_dim}] k[{kv_heads}x{head_dim}]",
                "ours_ms": t(lambda: norms.fused_qk_gemma_rmsnorm(q, k, qw, kw, EPS, head_dim)),
                "ref_name": "2 x HF Qwen3_5MoeRMSNorm",
                "ref_ms": t(
                    lambda: (
                        hf_q(q.view(tokens, heads, head_dim)),
                        hf_k(k.view(tokens, kv_heads, head_dim)),
                    )
                ),
                "bytes": 2 * (q.numel() + k.numel()) * size,
            },
            {
                "kernel": "gated_rmsnorm",
                "shape": f"[{tokens}, {v_heads}, {dv}]",
                "ours_ms": t(lambda: norms.gated_rmsnorm(o, z, gw, EPS)),
                "ref_name": "HF Qwen3_5MoeRMSNormGated",
                "ref_ms": t(lambda: hf_gated(o, z)),
                "bytes": 3 * o.numel() * size,
            },
        ]
