"""Feed-forward blocks: the dense SiLU-gated MLP and the sparse MoE block with a gated shared expert.

Both return this rank's partial sum under tensor parallelism; the decoder layer reduces it over the world (or over
the DP-attention gather). The dense MLP and the shared expert split the intermediate dimension over all ranks; the
routed experts split E ways over the expert-parallel ranks (``--ep-size``) and each expert's intermediate dimension
over the ``tp / ep`` ranks that share it. The router gate and the shared-expert gate are replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_lite.config import ModelConfig, shard_size
from sglang_lite.distributed import get_parallel_state
from sglang_lite.kernels import cpu as cpu_kernels
from sglang_lite.kernels import fused_moe, moe_route
from sglang_lite.kernels.dispatch import as_decode_blocks
from sglang_lite.layers.linear import (
    NO_SPLIT,
    Linear,
    PackedLinear,
    Shard,
    ShardMap,
    Split,
    input_columns,
    packed_rows,
    quant_block,
    weight_of,
)
from sglang_lite.layers.norm import GemmaRMSNorm
from sglang_lite.quantization import QuantizationConfig
from sglang_lite.streams.runtime import PLAIN, OverlapContext, overlap


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up packed into one GEMM; ``split``: this rank's part of the
    intermediate dimension (``intermediate_size`` is the whole)."""

    def __init__(self, hidden_size: int, intermediate_size: int, split: Split = NO_SPLIT) -> None:
        super().__init__()
        self.split, self.intermediate_size = split, intermediate_size
        local = shard_size(intermediate_size, split.parts, "intermediate_size")
        self.gate_up_proj = PackedLinear(hidden_size, [local, local])
        self.down_proj = Linear(local, hidden_size)

    def packed_shards(self) -> ShardMap:
        names = ["gate_proj.weight", "up_proj.weight"]
        if self.split.parts == 1:
            return packed_rows("gate_up_proj.weight", self.gate_up_proj, names)
        rows = self.split.rows(self.intermediate_size)
        return packed_rows(
            "gate_up_proj.weight", self.gate_up_proj, names, [rows, rows]
        ) | input_columns("down_proj.weight", self.split, self.intermediate_size)

    def forward(self, x: torch.Tensor, ctx: OverlapContext = PLAIN) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if as_decode_blocks(gate_up):  # batch invariant: the block's silu * up
            return self.down_proj(cpu_kernels.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def prepare_decode_block(self, norm: GemmaRMSNorm) -> None:
        """Gathers what ``decode_block`` reads: ``norm`` (the post-attention norm) and the weights as laid out now."""
        self._decode_args = (
            cpu_kernels.Norm(norm.weight, norm.eps),
            weight_of(self.gate_up_proj),
            weight_of(self.down_proj),
            quant_block(self.gate_up_proj, self.down_proj),
        )

    def decode_block(
        self, hidden: torch.Tensor, residual: torch.Tensor, bf16_dot: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The post-attention norm and this MLP over a decode batch in one C++ call: (partial sum, residual)."""
        return cpu_kernels.mlp_decode_block(hidden, residual, *self._decode_args, bf16_dot)

    def add_decode_block(self, layers: cpu_kernels.DecodeLayers) -> None:
        """This block, as ``decode_block`` runs it, into a whole model's ``layers``."""
        layers.add_mlp(*self._decode_args)


def shared_expert_fusion_supported(
    config: ModelConfig, quantization: QuantizationConfig | None = None
) -> tuple[bool, str]:
    """Fusion makes the shared expert one more row of the expert weights, so its sizes must match theirs, and the
    weights' ``quantization`` (the one in use) must allow it (MXFP4 does not, as upstream)."""
    if not config.is_moe or config.shared_expert_intermediate_size == 0:
        return False, "the model has no shared expert"
    if quantization is not None and not quantization.fuses_shared_experts:
        return (
            False,
            f"{quantization.format_name} weights run the shared expert beside the routed ones",
        )
    if config.shared_expert_intermediate_size != config.moe_intermediate_size:
        return False, (
            f"shared_expert_intermediate_size ({config.shared_expert_intermediate_size}) != "
            f"moe_intermediate_size ({config.moe_intermediate_size})"
        )
    return True, ""


class Qwen3_5SparseMoeBlock(nn.Module):
    """Softmax top-k router with renormalised weights, routed experts, and a sigmoid-gated shared expert.

    With ``fuse_shared_expert`` the shared expert is expert ``E`` of the fused MoE (loaded into the last row of
    ``w13`` / ``w2``) and is always selected with weight sigmoid(shared_expert_gate(x)): one fused call runs
    top_k + 1 experts. Otherwise it runs beside the routed experts, on the alternate stream when the plan says so.
    Under expert parallelism each rank runs only the (token, expert) pairs of its own experts; a fused shared expert
    row holds this rank's slice of the shared intermediate dimension, zero-padded to the experts' width.
    """

    def __init__(self, config: ModelConfig, fuse_shared_expert: bool = False) -> None:
        super().__init__()
        state = get_parallel_state()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.fuse_shared_expert = fuse_shared_expert
        self.ep_size = state.moe_ep_size
        self.num_local = shard_size(self.num_experts, self.ep_size, "num_experts", "ep size")
        self.first_expert = state.moe_ep_rank * self.num_local
        # of each routed expert's intermediate dim
        self.expert_split = Split(state.moe_tp_rank, state.moe_tp_size)
        self.shared_split = Split(state.rank, state.world_size)  # of the shared expert's
        hidden, self.inter = config.hidden_size, config.moe_intermediate_size
        inter = shard_size(self.inter, self.expert_split.parts, "moe_intermediate_size")
        self.shared_inter = config.shared_expert_intermediate_size
        rows = self.num_local + int(fuse_shared_expert)
        self.gate = Linear(hidden, self.num_experts)
        self.experts = nn.Module()
        self.experts.w13 = nn.Parameter(torch.zeros(rows, 2 * inter, hidden))
        self.experts.w2 = nn.Parameter(torch.zeros(rows, hidden, inter))
        if not fuse_shared_expert:
            self.shared_expert = GatedMLP(hidden, self.shared_inter, self.shared_split)
        else:
            shard_size(
                self.shared_inter, self.shared_split.parts, "shared_expert_intermediate_size"
            )
        self.shared_expert_gate = Linear(hidden, 1)

    def packed_shards(self) -> ShardMap:
        """A fused shared expert is one more row of the expert weights; the routed experts are declared apart, in
        the layout the checkpoint uses (``per_expert_shards`` or ``fused_expert_shards``)."""
        if not self.fuse_shared_expert:
            return {}
        return self._expert_rows(
            "shared_expert", self.num_local, self.shared_split, self.shared_inter
        )

    def per_expert_shards(self) -> ShardMap:
        """One gate, up and down matrix per expert: ``experts.{e}.gate_proj.weight`` [I, H] and so on; another
        rank's experts are read by that rank only."""
        shards: ShardMap = {}
        for e in range(self.num_experts):
            row = e - self.first_expert
            if 0 <= row < self.num_local:
                shards |= self._expert_rows(f"experts.{e}", row, self.expert_split, self.inter)
            else:
                shards |= {
                    f"experts.{e}.{name}.weight": []
                    for name in ("gate_proj", "up_proj", "down_proj")
                }
        return shards

    def fused_expert_shards(self) -> ShardMap:
        """transformers' fused layout: ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I]."""
        rows = slice(0, self.num_local)
        if self.ep_size == 1 and self.expert_split.parts == 1:
            return {
                "experts.gate_up_proj": [Shard("experts.w13", (rows,))],
                "experts.down_proj": [Shard("experts.w2", (rows,))],
            }
        mine = slice(self.first_expert, self.first_expert + self.num_local)
        cols, inter = self.expert_split.rows(self.inter), self.experts.w2.shape[-1]
        up = slice(self.inter + cols.start, self.inter + cols.stop)
        return {
            "experts.gate_up_proj": [
                Shard("experts.w13", (rows, slice(0, inter)), (mine, cols)),
                Shard("experts.w13", (rows, slice(inter, 2 * inter)), (mine, up)),
            ],
            "experts.down_proj": [Shard("experts.w2", (rows,), (mine, slice(None), cols))],
        }

    def _expert_rows(self, prefix: str, row: int, split: Split, total: int) -> ShardMap:
        """Expert ``row`` of w13 / w2 from one gate, up and down matrix, this rank's ``split`` of their ``total``
        intermediate size (zero-padded when narrower than the row)."""
        width, n = self.experts.w2.shape[-1], total // split.parts
        whole = split.parts == 1
        rows, cols = (
            () if whole else (split.rows(total),),
            () if whole else (slice(None), split.rows(total)),
        )
        return {
            f"{prefix}.gate_proj.weight": [Shard("experts.w13", (row, slice(0, n)), rows)],
            f"{prefix}.up_proj.weight": [
                Shard("experts.w13", (row, slice(width, width + n)), rows)
            ],
            f"{prefix}.down_proj.weight": [
                Shard("experts.w2", (row, slice(None), slice(0, n)), cols)
            ],
        }

    def prepare_decode_block(self, norm: GemmaRMSNorm) -> None:
        """Gathers what ``decode_block`` reads: ``norm`` (the post-attention norm) and the weights as laid out now.
        Expert parallelism takes the modules' path (its pairs are filtered first)."""
        assert self.ep_size == 1, "the decode block runs every expert of the layer"
        shared, shared_layers = None, []
        if not self.fuse_shared_expert:
            shared_layers = [self.shared_expert.gate_up_proj, self.shared_expert.down_proj]
            shared = tuple(weight_of(layer) for layer in shared_layers)
        self._decode_args = (
            cpu_kernels.Norm(norm.weight, norm.eps),
            (self.gate.weight, self.shared_expert_gate.weight),
            *cpu_kernels.Weight.experts_of(self),
            shared,
            self.top_k,
            self.num_experts if self.fuse_shared_expert else -1,
            getattr(self, "block", None) or quant_block(*shared_layers),
        )

    def decode_block(
        self, hidden: torch.Tensor, residual: torch.Tensor, bf16_dot: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The post-attention norm and this block over a decode batch in one C++ call: (partial sum, residual)."""
        return cpu_kernels.moe_decode_block(hidden, residual, *self._decode_args, bf16_dot)

    def add_decode_block(self, layers: cpu_kernels.DecodeLayers) -> None:
        """This block, as ``decode_block`` runs it, into a whole model's ``layers``."""
        layers.add_moe(*self._decode_args)

    def forward(self, x: torch.Tensor, ctx: OverlapContext = PLAIN) -> torch.Tensor:
        if self.fuse_shared_expert:
            return self._fused(x)
        if as_decode_blocks(x):  # batch invariant: the shared expert added as the block adds it
            shared_logit = self.shared_expert_gate(x)
            return cpu_kernels.add_gated(self._routed(x), self.shared_expert(x), shared_logit)
        # The shared expert only reads x and fused_moe does not write into its input, so no clone is needed.
        shared, routed = overlap(
            lambda: self._shared(x), lambda: self._routed(x), ctx.alt, ctx.plan.moe_shared_routed, x
        )
        return routed + shared

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = moe_route(self.gate(x), None, self.top_k, renormalize=True)
        return self._experts(x, weights, ids)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        # the shared expert is one more column: id E, weight sigmoid(shared_expert_gate(x))
        weights, ids = moe_route(
            self.gate(x), self.shared_expert_gate(x), self.top_k, True, self.num_experts
        )
        return self._experts(x, weights, ids)

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The fused MoE over this rank's experts; ``ids`` are global (the fused shared expert is id E)."""
        w13, w2 = self.experts.w13, self.experts.w2
        if self.ep_size == 1:
            return fused_moe(x, w13, w2, weights, ids)
        shared, local = ids == self.num_experts, ids - self.first_expert
        mine = shared | ((local >= 0) & (local < self.num_local))
        local = torch.where(shared, self.num_local, local)
        if x.is_cuda:  # no host sync (CUDA graphs): other ranks' pairs run on row 0 with weight 0
            return fused_moe(x, w13, w2, weights * mine, torch.where(mine, local, 0).to(ids.dtype))
        tokens, slots = mine.nonzero(as_tuple=True)
        out = x.new_zeros(x.shape)
        if tokens.numel():
            pair_ids = local[tokens, slots, None].to(ids.dtype)
            pairs = fused_moe(x[tokens], w13, w2, weights[tokens, slots, None], pair_ids)
            out.index_add_(0, tokens, pairs)
        return out
