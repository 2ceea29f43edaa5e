"""Feed-forward blocks: the dense SiLU-gated MLP and the sparse MoE block with a gated shared expert."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_lite.config import ModelConfig
from sglang_lite.kernels import fused_moe, topk_softmax
from sglang_lite.layers.linear import PackedLinear, ShardMap, packed_rows
from sglang_lite.streams.runtime import PLAIN, OverlapContext, overlap


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up packed into one GEMM."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = PackedLinear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def packed_shards(self) -> ShardMap:
        return packed_rows("gate_up_proj.weight", self.gate_up_proj, ["gate_proj.weight", "up_proj.weight"])

    def forward(self, x: torch.Tensor, ctx: OverlapContext = PLAIN) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def shared_expert_fusion_supported(config: ModelConfig) -> tuple[bool, str]:
    """Fusion makes the shared expert one more row of the expert weights, so its sizes must match theirs."""
    if not config.is_moe or config.shared_expert_intermediate_size == 0:
        return False, "the model has no shared expert"
    if config.shared_expert_intermediate_size != config.moe_intermediate_size:
        return False, (f"shared_expert_intermediate_size ({config.shared_expert_intermediate_size}) != "
                       f"moe_intermediate_size ({config.moe_intermediate_size})")
    return True, ""


class Qwen3_5SparseMoeBlock(nn.Module):
    """Softmax top-k router with renormalised weights, routed experts, and a sigmoid-gated shared expert.

    With ``fuse_shared_expert`` the shared expert is expert ``E`` of the fused MoE (loaded into the last row of
    ``w13`` / ``w2``) and is always selected with weight sigmoid(shared_expert_gate(x)): one fused call runs
    top_k + 1 experts. Otherwise it runs beside the routed experts, on the alternate stream when the plan says so.
    """

    def __init__(self, config: ModelConfig, fuse_shared_expert: bool = False) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.fuse_shared_expert = fuse_shared_expert
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        rows = self.num_experts + int(fuse_shared_expert)
        self.gate = nn.Linear(hidden, self.num_experts, bias=False)
        self.experts = nn.Module()
        self.experts.w13 = nn.Parameter(torch.empty(rows, 2 * inter, hidden))
        self.experts.w2 = nn.Parameter(torch.empty(rows, hidden, inter))
        if not fuse_shared_expert:
            self.shared_expert = GatedMLP(hidden, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def packed_shards(self) -> ShardMap:
        """A fused shared expert is one more row of the expert weights; the routed experts are declared apart, in
        the layout the checkpoint uses (``per_expert_shards`` or ``fused_expert_shards``)."""
        return self._expert_rows("shared_expert", self.num_experts) if self.fuse_shared_expert else {}

    def per_expert_shards(self) -> ShardMap:
        """One gate, up and down matrix per expert: ``experts.{e}.gate_proj.weight`` [I, H] and so on."""
        shards: ShardMap = {}
        for e in range(self.num_experts):
            shards |= self._expert_rows(f"experts.{e}", e)
        return shards

    def fused_expert_shards(self) -> ShardMap:
        """transformers' fused layout: ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I]."""
        rows = slice(0, self.num_experts)
        return {"experts.gate_up_proj": ("experts.w13", (rows,)), "experts.down_proj": ("experts.w2", (rows,))}

    def _expert_rows(self, prefix: str, row: int) -> ShardMap:
        inter = self.experts.w2.shape[-1]
        return {
            f"{prefix}.gate_proj.weight": ("experts.w13", (row, slice(0, inter))),
            f"{prefix}.up_proj.weight": ("experts.w13", (row, slice(inter, 2 * inter))),
            f"{prefix}.down_proj.weight": ("experts.w2", (row,)),
        }

    def forward(self, x: torch.Tensor, ctx: OverlapContext = PLAIN) -> torch.Tensor:
        if self.fuse_shared_expert:
            return self._fused(x)
        # The shared expert only reads x and fused_moe does not write into its input, so no clone is needed.
        shared, routed = overlap(lambda: self._shared(x), lambda: self._routed(x), ctx.alt,
                                 ctx.plan.moe_shared_routed, x)
        return routed + shared

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = topk_softmax(self.gate(x), self.top_k, renormalize=True)
        return fused_moe(x, self.experts.w13, self.experts.w2, weights, ids)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = topk_softmax(self.gate(x), self.top_k, renormalize=True)
        shared_weight = torch.sigmoid(self.shared_expert_gate(x).float())
        shared_id = torch.full_like(ids[:, :1], self.num_experts)
        return fused_moe(x, self.experts.w13, self.experts.w2, torch.cat([weights, shared_weight], dim=1),
                         torch.cat([ids, shared_id], dim=1))
