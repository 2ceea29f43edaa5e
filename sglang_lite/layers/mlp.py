"""Feed-forward blocks: the dense SiLU-gated MLP and the sparse MoE block with a gated shared expert."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_lite.config import ModelConfig
from sglang_lite.kernels import fused_moe, topk_softmax
from sglang_lite.layers.linear import PackedLinear, ShardMap, packed_rows


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up packed into one GEMM."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = PackedLinear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def packed_shards(self, fused_experts: bool) -> ShardMap:
        return packed_rows("gate_up_proj.weight", self.gate_up_proj, ["gate_proj.weight", "up_proj.weight"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Qwen3_5SparseMoeBlock(nn.Module):
    """Softmax top-k router with renormalised weights, routed experts, and a sigmoid-gated shared expert."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.gate = nn.Linear(hidden, self.num_experts, bias=False)
        self.experts = nn.Module()
        self.experts.w13 = nn.Parameter(torch.empty(self.num_experts, 2 * inter, hidden))
        self.experts.w2 = nn.Parameter(torch.empty(self.num_experts, hidden, inter))
        self.shared_expert = GatedMLP(hidden, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def packed_shards(self, fused_experts: bool) -> ShardMap:
        if fused_experts:  # transformers' fused layout: gate_up_proj [E, 2I, H], down_proj [E, H, I]
            return {"experts.gate_up_proj": ("experts.w13", ()), "experts.down_proj": ("experts.w2", ())}
        inter = self.experts.w2.shape[-1]
        shards: ShardMap = {}
        for e in range(self.num_experts):
            shards[f"experts.{e}.gate_proj.weight"] = ("experts.w13", (e, slice(0, inter)))
            shards[f"experts.{e}.up_proj.weight"] = ("experts.w13", (e, slice(inter, 2 * inter)))
            shards[f"experts.{e}.down_proj.weight"] = ("experts.w2", (e,))
        return shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = topk_softmax(self.gate(x), self.top_k, renormalize=True)
        routed = fused_moe(x, self.experts.w13, self.experts.w2, weights, ids)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
