"""Gated DeltaNet linear attention of Qwen3.5 (packed in_proj_qkvz and in_proj_ba, conv1d, gated delta rule).

Tensor parallel over the attention group by key and value heads together (each rank holds whole groups of HV/HK
value heads per key head): the q, k, v, z rows of ``in_proj_qkvz``, the b, a rows of ``in_proj_ba``, the conv1d
channels, ``A_log`` and ``dt_bias`` follow their heads, and so do the conv and recurrent states in the pools;
``out_proj`` is row-parallel with one all-reduce. The gated norm's weight is per head dimension: replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang_lite.config import ModelConfig
from sglang_lite.distributed import attn_all_reduce, get_parallel_state
from sglang_lite.forward_batch import ForwardBatch
from sglang_lite.kernels import (
    causal_conv1d_fn,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    fused_gdn_gating,
    fused_recurrent_gated_delta_rule,
)
from sglang_lite.kernels import cpu as cpu_kernels
from sglang_lite.layers.linear import (
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
from sglang_lite.layers.norm import GatedRMSNorm, GemmaRMSNorm
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.streams.runtime import overlap


class Qwen3_5GatedDeltaNet(nn.Module):
    fp32_params = ("A_log",)  # the decay rate stays fp32 whatever the model dtype

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        state = get_parallel_state()
        self.split = Split(state.attn_tp_rank, state.attn_tp_size)
        local = config.attention_shard(state.attn_tp_size)
        self.num_k_heads = local.linear_num_key_heads
        self.num_v_heads = local.linear_num_value_heads
        self.head_k_dim = local.linear_key_head_dim
        self.head_v_dim = local.linear_value_head_dim
        self.key_dim = local.linear_key_dim
        self.value_dim = local.linear_value_dim
        self.conv_dim = local.conv_dim
        hidden = config.hidden_size
        self.in_proj_qkvz = PackedLinear(hidden, [self.conv_dim, self.value_dim])
        self.in_proj_ba = PackedLinear(hidden, [self.num_v_heads, self.num_v_heads])
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(
            torch.empty(self.conv_dim, 1, config.linear_conv_kernel_dim)
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, hidden)

    def packed_shards(self) -> ShardMap:
        qkvz_names = ["in_proj_qkv.weight", "in_proj_z.weight"]
        ba_names = ["in_proj_b.weight", "in_proj_a.weight"]
        if self.split.parts == 1:
            return packed_rows("in_proj_qkvz.weight", self.in_proj_qkvz, qkvz_names) | packed_rows(
                "in_proj_ba.weight", self.in_proj_ba, ba_names
            )
        rank, parts = self.split.rank, self.split.parts
        kd, vd = self.key_dim, self.value_dim
        # this rank's q, k and v channels: where they sit in the checkpoint's [q | k | v] and in the local packing
        channels = [
            (slice(rank * kd, (rank + 1) * kd), slice(0, kd)),
            (slice(parts * kd + rank * kd, parts * kd + (rank + 1) * kd), slice(kd, 2 * kd)),
            (
                slice(2 * parts * kd + rank * vd, 2 * parts * kd + (rank + 1) * vd),
                slice(2 * kd, 2 * kd + vd),
            ),
        ]
        heads = self.split.rows(parts * self.num_v_heads)
        shards: ShardMap = {
            "in_proj_qkv.weight": [
                Shard("in_proj_qkvz.weight", (dest,), (src,)) for src, dest in channels
            ],
            "in_proj_z.weight": [
                Shard(
                    "in_proj_qkvz.weight",
                    (slice(self.conv_dim, self.conv_dim + vd),),
                    (self.split.rows(parts * vd),),
                )
            ],
            "conv1d.weight": [Shard("conv1d.weight", (dest,), (src,)) for src, dest in channels],
            "dt_bias": [Shard("dt_bias", (), (heads,))],
            "A_log": [Shard("A_log", (), (heads,))],
        }
        shards |= packed_rows("in_proj_ba.weight", self.in_proj_ba, ba_names, [heads, heads])
        return shards | input_columns("out_proj.weight", self.split, parts * vd)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        ctx = batch.overlap
        qkvz, ba = overlap(
            lambda: self.in_proj_qkvz(hidden),
            lambda: self.in_proj_ba(hidden),
            ctx.alt,
            ctx.plan.gdn_qkvz_ba,
            hidden,
        )
        qkv, z = qkvz.split(self.in_proj_qkvz.output_sizes, dim=-1)
        b, a = ba.split(self.in_proj_ba.output_sizes, dim=-1)
        g, beta = fused_gdn_gating(self.A_log, a, self.dt_bias, b)
        if batch.verify is not None:
            o = self._verify_steps(qkv, g, beta, batch)
        else:
            o = self._mix(qkv, g, beta, batch)
        o = self.norm(o, z.reshape(num_tokens, self.num_v_heads, self.head_v_dim))
        return attn_all_reduce(self.out_proj(o.reshape(num_tokens, self.value_dim)))

    def _mix(
        self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """The conv and the gated delta rule over the batch's tokens: [T, HV, dv]."""
        conv_states, ssm_states = batch.pools.state_buffers(self.layer_id)
        q, k, v = self._heads(self._conv(qkv, conv_states, batch))
        if batch.is_decode:
            return fused_recurrent_gated_delta_rule(q, k, v, g, beta, ssm_states, batch.state_slots)
        return chunk_gated_delta_rule(
            q, k, v, g, beta, ssm_states, batch.state_slots, batch.cu_seqlens
        )

    def _verify_steps(
        self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """A verify forward's conv and recurrence one token of each request at a time (the decode kernels, as a
        decode step runs them), keeping the states after each token in ``batch.verify``. Its rows are tokens
        (``build_rows_batch``), each holding its request's state slot."""
        assert batch.is_decode, "a verify forward runs one row a token (build_rows_batch)"
        conv_states, ssm_states = batch.pools.state_buffers(self.layer_id)
        weight = self.conv1d.weight.squeeze(1)
        layer = batch.pools.linear_index[self.layer_id]
        out = qkv.new_empty((qkv.shape[0], self.num_v_heads, self.head_v_dim))
        for step, (tokens, _) in enumerate(batch.verify.steps):
            slots = batch.state_slots[tokens]
            q, k, v = self._heads(causal_conv1d_update(qkv[tokens], weight, conv_states, slots))
            out[tokens] = fused_recurrent_gated_delta_rule(
                q, k, v, g[tokens], beta[tokens], ssm_states, slots
            ).to(out.dtype)
            batch.verify.record(step, layer, conv_states, ssm_states, slots)
        return out

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_tokens = qkv.shape[0]
        pieces = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = pieces[0].view(num_tokens, self.num_k_heads, self.head_k_dim)
        k = pieces[1].view(num_tokens, self.num_k_heads, self.head_k_dim)
        v = pieces[2].view(num_tokens, self.num_v_heads, self.head_v_dim)
        return q, k, v

    def prepare_decode_block(self, norm: GemmaRMSNorm) -> None:
        """Gathers what ``decode_block`` reads: ``norm`` (the layer's input norm) and this mixer's weights as they
        are laid out now (the runner calls this after ``weight_layout``)."""
        self._decode_args = (
            cpu_kernels.Norm(norm.weight, norm.eps),
            weight_of(self.in_proj_qkvz),
            weight_of(self.in_proj_ba),
            self.conv1d.weight.squeeze(1),
            self.A_log,
            self.dt_bias,
            cpu_kernels.Norm(self.norm.weight, self.norm.eps),
            weight_of(self.out_proj),
        )
        self._decode_heads = cpu_kernels.GdnHeads(
            self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        )
        self._decode_quant = quant_block(self.in_proj_qkvz, self.in_proj_ba, self.out_proj)

    def decode_block(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        bf16_dot: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The input norm and this mixer over a decode batch, or a prefill's tokens (``takes_prefill_block``), in
        one C++ call: (output, residual)."""
        out, residual = cpu_kernels.gdn_decode_block(
            hidden,
            residual,
            *self._decode_args,
            batch.pools.state_buffers(self.layer_id),
            batch.state_slots,
            self._decode_heads,
            self._decode_quant,
            bf16_dot,
            None if batch.is_decode else batch.cu_seqlens,
        )
        return attn_all_reduce(out), residual

    @staticmethod
    def takes_prefill_block(batch: ForwardBatch) -> bool:
        """Whether ``decode_block`` runs this forward's tokens as a prefill: an extend batch (not a verify one)."""
        return not batch.is_decode and batch.verify is None and batch.cu_seqlens is not None

    def add_decode_block(self, layers: cpu_kernels.DecodeLayers, pools: ModelPools) -> None:
        """This block, as ``decode_block`` runs it, into a whole model's ``layers`` (one rank, no reduction)."""
        layers.add_gdn(
            *self._decode_args,
            pools.state_buffers(self.layer_id),
            self._decode_heads,
            self._decode_quant,
            pools.linear_index[self.layer_id],
        )

    def _conv(
        self, qkv: torch.Tensor, conv_states: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        weight = self.conv1d.weight.squeeze(1)
        if batch.is_decode:
            return causal_conv1d_update(qkv, weight, conv_states, batch.state_slots)
        return causal_conv1d_fn(qkv, weight, conv_states, batch.state_slots, batch.cu_seqlens)
