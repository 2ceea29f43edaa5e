"""Gated full attention of Qwen3.5: packed qkv, per-head QK Gemma RMSNorm, partial NeoX RoPE, sigmoid output gate.

Tensor parallel over the attention group: ``qkv_proj`` column-parallel by heads (each query head with its gate; KV
heads split, or replicated when fewer than the ranks), ``o_proj`` row-parallel with one all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang_lite.config import ModelConfig
from sglang_lite.distributed import attn_all_reduce, get_parallel_state
from sglang_lite.forward_batch import ForwardBatch
from sglang_lite.kernels import cpu as cpu_kernels
from sglang_lite.kernels import decode_attention, extend_attention, fused_qk_gemma_rmsnorm, store_kv
from sglang_lite.kernels.dispatch import as_decode_blocks
from sglang_lite.layers.linear import (
    Linear,
    PackedLinear,
    ShardMap,
    Split,
    input_columns,
    packed_rows,
    quant_block,
    weight_of,
)
from sglang_lite.layers.norm import GemmaRMSNorm
from sglang_lite.layers.rotary import RotaryEmbedding
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.streams.runtime import OverlapContext, overlap


class Qwen3_5Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_id = layer_id
        state = get_parallel_state()
        self.split = Split(state.attn_tp_rank, state.attn_tp_size)
        local = config.attention_shard(state.attn_tp_size)
        self.num_heads, self.num_kv_heads = local.num_attention_heads, local.num_key_value_heads
        self.total_kv_heads = config.num_key_value_heads
        self.head_dim = hd = config.head_dim
        self.scale = hd**-0.5
        # q_proj rows are interleaved per head as [q_h | gate_h]
        kv_size = self.num_kv_heads * hd
        self.qkv_proj = PackedLinear(
            config.hidden_size, [2 * self.num_heads * hd, kv_size, kv_size]
        )
        self.o_proj = Linear(self.num_heads * hd, config.hidden_size)
        self.q_norm = GemmaRMSNorm(hd, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(hd, config.rms_norm_eps)
        # shared table, owned by the model (a tuple keeps it out of this module's children)
        self._rotary = (rotary,)

    def packed_shards(self) -> ShardMap:
        names = ["q_proj.weight", "k_proj.weight", "v_proj.weight"]
        if self.split.parts == 1:
            return packed_rows("qkv_proj.weight", self.qkv_proj, names)
        hd, rank = self.head_dim, self.split.rank
        # [q_h | gate_h] rows
        q_rows = slice(rank * 2 * self.num_heads * hd, (rank + 1) * 2 * self.num_heads * hd)
        if self.total_kv_heads >= self.split.parts:
            first_kv = rank * self.num_kv_heads
        else:  # replicated: the KV head this rank's query heads use
            first_kv = rank // (self.split.parts // self.total_kv_heads)
        kv_rows = slice(first_kv * hd, (first_kv + self.num_kv_heads) * hd)
        qkv = packed_rows("qkv_proj.weight", self.qkv_proj, names, [q_rows, kv_rows, kv_rows])
        return qkv | input_columns(
            "o_proj.weight", self.split, self.split.parts * self.num_heads * hd
        )

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        pieces = self.qkv_proj(hidden).split(self.qkv_proj.output_sizes, dim=-1)
        q_gate = pieces[0].view(num_tokens, self.num_heads, 2 * self.head_dim)
        q, gate = q_gate[..., : self.head_dim], q_gate[..., self.head_dim :]
        k = pieces[1].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = pieces[2].view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self._qk_norm(q, k, batch.overlap)
        q, k = self._rotary[0](batch.positions, q, k, batch.mrope_positions)
        out = self._attend(q, k, v, batch)
        # gated per head, then heads merged: gate is a strided view, which a merge first would have copied
        # batch invariant: the block's gate (a prompt token's = a decode token's)
        if as_decode_blocks(out, gate):
            return attn_all_reduce(self.o_proj(cpu_kernels.sigmoid_gate(out, gate).flatten(1)))
        return attn_all_reduce(self.o_proj((out * torch.sigmoid(gate)).flatten(1)))

    def prepare_decode_block(self, norm: GemmaRMSNorm) -> None:
        """Gathers what ``decode_block`` reads: ``norm`` (the layer's input norm) and this mixer's weights as they
        are laid out now (the runner calls this after ``weight_layout``)."""
        rotary = self._rotary[0]
        self._decode_args = (
            cpu_kernels.Norm(norm.weight, norm.eps),
            weight_of(self.qkv_proj),
            (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps),
            weight_of(self.o_proj),
            (rotary.cos_sin_cache, rotary.rotary_dim),
        )
        self._decode_heads = cpu_kernels.AttentionHeads(
            self.num_heads, self.num_kv_heads, self.head_dim, self.scale
        )
        self._decode_quant = quant_block(self.qkv_proj, self.o_proj)

    def decode_block(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        bf16_dot: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The input norm and this mixer over a decode batch, or a prefill's tokens (``takes_prefill_block``), in
        one C++ call: (output, residual)."""
        requests = (
            batch.pools.req_to_token.page_table,
            batch.req_pool_indices,
            batch.seq_lens_t,
            batch.positions,
            batch.out_cache_loc,
        )
        extend = None if batch.is_decode else (batch.prefix_lens_t, batch.extend_lens_t)
        out, residual = cpu_kernels.attention_decode_block(
            hidden,
            residual,
            *self._decode_args,
            batch.pools.kv_buffers(self.layer_id),
            requests,
            self._decode_heads,
            batch.pools.page_size,
            self._decode_quant,
            bf16_dot,
            extend,
        )
        return attn_all_reduce(out), residual

    @staticmethod
    def takes_prefill_block(batch: ForwardBatch) -> bool:
        """Whether ``decode_block`` runs this forward's tokens as a prefill: an extend batch (not a verify one) with
        1-D positions (M-RoPE's image positions take the modules)."""
        return not batch.is_decode and batch.verify is None and batch.mrope_positions is None

    def add_decode_block(self, layers: cpu_kernels.DecodeLayers, pools: ModelPools) -> None:
        """This block, as ``decode_block`` runs it, into a whole model's ``layers`` (one rank, no reduction)."""
        layers.add_attention(
            *self._decode_args,
            pools.kv_buffers(self.layer_id),
            pools.req_to_token.page_table,
            self._decode_heads,
            pools.page_size,
            self._decode_quant,
        )

    def _qk_norm(
        self, q: torch.Tensor, k: torch.Tensor, ctx: OverlapContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if ctx.plan.qk_norm:
            return overlap(lambda: self.q_norm(q), lambda: self.k_norm(k), ctx.alt, True, k)
        if ctx.plan.fused_qk_norm:
            return fused_qk_gemma_rmsnorm(
                q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.head_dim
            )
        return self.q_norm(q), self.k_norm(k)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        k_cache, v_cache = batch.pools.kv_buffers(self.layer_id)
        store_kv(k_cache, v_cache, batch.out_cache_loc, k, v)
        table, rows = batch.pools.req_to_token.page_table, batch.req_pool_indices
        page_size = batch.pools.page_size
        if batch.is_decode:
            return decode_attention(
                q,
                k_cache,
                v_cache,
                table,
                rows,
                batch.seq_lens_t,
                self.scale,
                page_size=page_size,
                max_seq_len=batch.max_seq_len,
            )
        return extend_attention(
            q,
            k_cache,
            v_cache,
            table,
            rows,
            batch.prefix_lens_t,
            batch.extend_lens_t,
            self.scale,
            page_size=page_size,
        )
