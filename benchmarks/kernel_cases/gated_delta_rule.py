"""Benchmark and GPU-check cases for the gated delta rule (gating, chunked prefill, recurrent decode)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from sglang_lite.kernels import gated_delta_rule as gdn
from sglang_lite.kernels.gated_delta_rule import naive

from ._compare import check_row
from ._timing import time_ms


def _cu(lens: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)


def _inputs(
    tokens: int,
    hk: int,
    hv: int,
    dk: int,
    dv: int,
    dtype: torch.dtype,
    slots: int,
    device: torch.device,
):
    q, k = (torch.randn(tokens, hk, dk, device=device, dtype=dtype) for _ in range(2))
    v = torch.randn(tokens, hv, dv, device=device, dtype=dtype)
    a, b = (torch.randn(tokens, hv, device=device) for _ in range(2))
    g, beta = naive.fused_gdn_gating(
        torch.rand(hv, device=device), a, torch.rand(hv, device=device), b
    )
    pool = 0.1 * torch.randn(slots, hv, dk, dv, device=device)
    return q, k, v, g, beta, pool


def check(device: torch.device) -> list[dict]:
    rows = []
    a, b = torch.randn(300, 32, device=device), torch.randn(300, 32, device=device)
    A_log, dt_bias = torch.randn(32, device=device), torch.randn(32, device=device)
    for name, got, want in zip(
        ("g", "beta"),
        gdn.fused_gdn_gating(A_log, a, dt_bias, b, backend="triton"),
        naive.fused_gdn_gating(A_log, a, dt_bias, b),
    ):
        rows.append(check_row(f"fused_gdn_gating {name}", got, want, 1e-4))
    lens = [1, 63, 300, 65]
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        for hk, hv, dk, dv in ((4, 8, 128, 128), (2, 6, 48, 80)):
            q, k, v, g, beta, pool = _inputs(sum(lens), hk, hv, dk, dv, dtype, 6, device)
            slots = torch.tensor([5, 1, 3, 2], device=device)
            got_pool, want_pool = pool.clone(), pool.clone()
            got = gdn.chunk_gated_delta_rule(
                q, k, v, g, beta, got_pool, slots, _cu(lens, device), backend="triton"
            )
            want = naive.chunk_gated_delta_rule(
                q, k, v, g, beta, want_pool, slots, _cu(lens, device)
            )
            tag = f"HK={hk} HV={hv} dk={dk} dv={dv} {dtype}"
            rows += [
                check_row(f"chunk_gated_delta_rule {tag}", got, want, tol),
                check_row(f"chunk final state {tag}", got_pool, want_pool, tol),
            ]
            got = gdn.fused_recurrent_gated_delta_rule(
                q[:4], k[:4], v[:4], g[:4], beta[:4], got_pool, slots, backend="triton"
            )
            want = naive.fused_recurrent_gated_delta_rule(
                q[:4], k[:4], v[:4], g[:4], beta[:4], want_pool, slots
            )
            rows += [
                check_row(f"fused_recurrent_gated_delta_rule {tag}", got, want, tol),
                check_row(f"recurrent state {tag}", got_pool, want_pool, tol),
            ]
    return rows


def _chunk_flops(tokens: int, hv: int, dk: int, dv: int, chunk: int = 64) -> int:
    """Matmul FLOPs of the chunked form: intra-chunk products and the three state products per token."""
    intra = 2 * chunk * (2 * dk + dv + dk + dv)  # QK^T, KK^T, T@[V|K], attn@V'
    state = 2 * 3 * dk * dv  # W S, Q S, K^T V'
    return tokens * hv * (intra + state)


def bench(device: torch.device, quick: bool) -> list[dict]:
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    tokens = 8192 if on_gpu and not quick else 2048
    hk, hv, dk, dv = (16, 32, 128, 128) if on_gpu else (8, 8, 64, 64)
    iters = 20
    q, k, v, g, beta, pool = _inputs(tokens, hk, hv, dk, dv, dtype, 2, device)
    one, cu = torch.tensor([1], device=device), _cu([tokens], device)
    batch = 64 if on_gpu else 8
    dq, dk_, dv_, dg, db, dpool = _inputs(batch, hk, hv, dk, dv, dtype, batch + 1, device)
    slots = torch.arange(1, batch + 1, device=device)
    A_log, dt_bias = torch.rand(hv, device=device), torch.rand(hv, device=device)
    a, b = (torch.randn(tokens, hv, device=device, dtype=dtype) for _ in range(2))

    def t(fn):
        return time_ms(fn, device, iters=iters, warmup=3)

    # transformers' functions take as many key as value heads (its model repeats them first)
    hq, hk_rep = (x.repeat_interleave(hv // hk, dim=1) for x in (q, k))
    dq_rep, dk_rep = (x.repeat_interleave(hv // hk, dim=1) for x in (dq, dk_))

    def hf_chunk():
        return torch_chunk_gated_delta_rule(
            hq[None],
            hk_rep[None],
            v[None],
            g[None],
            beta[None],
            initial_state=pool[1:2],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )

    def hf_recurrent():  # one token per request: requests become the batch dimension
        return torch_recurrent_gated_delta_rule(
            dq_rep[:, None],
            dk_rep[:, None],
            dv_[:, None],
            dg[:, None],
            db[:, None],
            initial_state=dpool[slots],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )

    def hf_gating():
        return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()

    io = q.element_size() * (2 * q.numel() + 2 * v.numel())
    state_bytes = 2 * batch * hv * dk * dv * 4
    return [
        {
            "kernel": "fused_gdn_gating",
            "shape": f"[{tokens}, {hv}]",
            "ours_ms": t(lambda: gdn.fused_gdn_gating(A_log, a, dt_bias, b)),
            "ref_name": "HF inline softplus/sigmoid",
            "ref_ms": t(hf_gating),
            "bytes": a.numel() * (2 * a.element_size() + 8),
        },
        {
            "kernel": "chunk_gated_delta_rule",
            "shape": f"B=1 T={tokens} HK={hk} HV={hv} d={dk}",
            "ours_ms": t(lambda: gdn.chunk_gated_delta_rule(q, k, v, g, beta, pool, one, cu)),
            "ref_name": "torch_chunk_gated_delta_rule",
            "ref_ms": t(hf_chunk),
            "flops": _chunk_flops(tokens, hv, dk, dv),
            "bytes": io,
        },
        {
            "kernel": "fused_recurrent_gated_delta_rule",
            "shape": f"B={batch} HK={hk} HV={hv} d={dk}",
            "ours_ms": t(
                lambda: gdn.fused_recurrent_gated_delta_rule(dq, dk_, dv_, dg, db, dpool, slots)
            ),
            "ref_name": "torch_recurrent_gated_delta_rule",
            "ref_ms": t(hf_recurrent),
            "bytes": state_bytes,
        },
    ]
