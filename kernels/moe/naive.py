"""Plain-PyTorch fused MoE; also the CPU path. Tokens are grouped by expert: one GEMM pair per expert hit.

Layouts: x [T, H]; w13 [E, 2I, H] (first I rows gate, next I up); w2 [E, H, I]; topk_weights [T, k] (fp32);
topk_ids [T, k]. The shared expert can ride along as an extra expert id with its own per-token weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def topk_softmax(
    router_logits: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in fp32, keep the top k, optionally renormalise them to sum to 1."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``sum_i w_i * down_e(silu(gate_e(x)) * up_e(x))`` over each token's selected experts."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    outputs = []
    for expert, rows in zip(range(len(counts)), torch.split(token_of, counts)):
        if rows.numel() == 0:
            continue
        gate, up = F.linear(x[rows], w13[expert]).chunk(2, dim=-1)
        outputs.append(F.linear(F.silu(gate) * up, w2[expert]))
    expert_out = torch.cat(outputs) if outputs else x.new_zeros(0, x.shape[1])
    weighted = expert_out.float() * topk_weights.reshape(-1)[order].float().unsqueeze(-1)
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, token_of, weighted)
    return out.to(x.dtype)
