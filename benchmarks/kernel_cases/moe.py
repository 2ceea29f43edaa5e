"""Benchmark and GPU-check cases for the fused MoE family (top-k softmax routing, fused shared expert)."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

from sglang_lite.kernels import moe
from sglang_lite.kernels.moe import naive

from ._compare import check_row
from ._timing import time_ms


def hf_block(
    hidden: int, inter: int, experts: int, top_k: int, device: torch.device, dtype: torch.dtype
):
    config = Qwen3_5MoeTextConfig(
        hidden_size=hidden,
        moe_intermediate_size=inter,
        shared_expert_intermediate_size=inter,
        num_experts=experts,
        num_experts_per_tok=top_k,
    )
    block = Qwen3_5MoeSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=hidden**-0.5)
    return block.to(device, dtype).eval()


class FusedSharedMoE:
    """Our MoE block with the same weights as ``block``: the shared expert is appended as expert E, so one
    topk_softmax and one fused_moe call (top_k + 1 experts per token) compute the whole block."""

    def __init__(self, block: Qwen3_5MoeSparseMoeBlock):
        shared = block.shared_expert
        self.top_k, self.num_experts = block.gate.top_k, block.experts.num_experts
        # router and shared-expert gate in one projection: [E + 1, H]
        self.gate = torch.cat([block.gate.weight, block.shared_expert_gate.weight]).detach()
        shared_gate_up = torch.cat([shared.gate_proj.weight, shared.up_proj.weight])
        self.w13 = torch.cat([block.experts.gate_up_proj, shared_gate_up[None]]).detach()
        self.w2 = torch.cat([block.experts.down_proj, shared.down_proj.weight[None]]).detach()

    def route(
        self, x: torch.Tensor, backend: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k routed experts plus expert E with weight sigmoid(shared_expert_gate(x)): [T, top_k + 1]."""
        logits = F.linear(x, self.gate)
        weights, ids = moe.topk_softmax(logits[:, : self.num_experts], self.top_k, backend=backend)
        weights = torch.cat([weights, torch.sigmoid(logits[:, self.num_experts :].float())], 1)
        ids = torch.cat([ids, ids.new_full((x.shape[0], 1), self.num_experts)], 1)
        return weights, ids

    def __call__(self, x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        weights, ids = self.route(x, backend)
        return moe.fused_moe(x, self.w13, self.w2, weights, ids, backend=backend)


def check(device: torch.device) -> list[dict]:
    rows = []
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        block = hf_block(256, 128, 16, 4, device, dtype)
        ours = FusedSharedMoE(block)
        x = torch.randn(65, 256, device=device, dtype=dtype)
        logits = torch.randn(65, 60, device=device, dtype=torch.float32)
        got, want = moe.topk_softmax(logits, 8, backend="triton"), naive.topk_softmax(logits, 8)
        rows.append(
            {
                "name": f"topk_softmax ids {dtype}",
                "ok": bool(torch.equal(got[1], want[1])),
                "max_rel_err": 0.0,
            }
        )
        rows.append(check_row(f"topk_softmax weights {dtype}", got[0], want[0], tol))
        with torch.no_grad():
            # one routing for both sides: bf16 router logits can tie, and ties may pick different experts
            weights, ids = ours.route(x, "torch")
            rows.append(
                check_row(
                    f"fused_moe+shared triton vs naive {dtype}",
                    moe.fused_moe(x, ours.w13, ours.w2, weights, ids, backend="triton"),
                    naive.fused_moe(x, ours.w13, ours.w2, weights, ids),
                    tol,
                )
            )
            if dtype == torch.float32:
                rows.append(
                    check_row(
                        "moe block triton vs HF block fp32",
                        ours(x, "triton"),
                        block(x[None])[0],
                        tol,
                    )
                )
    return rows


def _sizes(device: torch.device, quick: bool) -> list[tuple[int, int, int, int, int]]:
    """(tokens, hidden, moe_intermediate, experts, top_k)."""
    # the built-in tiny model's expert sizes, two small ones, Qwen3.5-MoE's own
    if device.type != "cuda":
        sizes = [(256, 128, 64, 16, 4), (256, 256, 128, 16, 4), (256, 512, 256, 16, 4)]
        return sizes if quick else sizes + [(256, 2048, 512, 16, 4)]
    if quick:
        return [(16, 2048, 512, 64, 8), (1024, 2048, 512, 64, 8)]
    return [(16, 2048, 512, 256, 8), (1024, 2048, 512, 256, 8), (8192, 2048, 512, 256, 8)]


def bench(device: torch.device, quick: bool) -> list[dict]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    iters = 20 if device.type == "cuda" else 10
    rows = []
    for tokens, hidden, inter, experts, top_k in _sizes(device, quick):
        block = hf_block(hidden, inter, experts, top_k, device, dtype)
        ours = FusedSharedMoE(block)
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        with torch.no_grad():
            ours_ms = time_ms(partial(ours, x), device, iters=iters, warmup=2)
            ref_ms = time_ms(partial(block, x[None]), device, iters=iters, warmup=2)
        rows.append(
            {
                "kernel": "moe block (topk_softmax + fused_moe, shared expert fused)",
                "shape": f"T={tokens} H={hidden} I={inter} E={experts} top{top_k}+shared",
                "ours_ms": ours_ms,
                "ref_name": "HF Qwen3_5MoeSparseMoeBlock",
                "ref_ms": ref_ms,
                "flops": 2 * 3 * tokens * (top_k + 1) * hidden * inter,
            }
        )
    return rows
