"""Qwen3.5 dense and MoE causal LMs: wiring of the shared layers (hybrid Gated DeltaNet + gated attention).

Built inside a tensor-parallel world (``sglang_lite.distributed``), every layer holds this rank's shard; the decoder
layer reduces the MLP's partial sums over the world, or, under DP attention, runs the MLP on the tokens of every
DP rank (gathered) and keeps its own rows of the sum. A DP rank with no tokens still joins each layer's MLP.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from sglang_lite.config import ModelConfig, quantization_config_in_use, shard_size
from sglang_lite.distributed import DPTokens, get_parallel_state, world_all_reduce
from sglang_lite.forward_batch import ForwardBatch
from sglang_lite.kernels import cpu as cpu_kernels
from sglang_lite.kernels.cpu import MOE_CHUNK_TOKENS
from sglang_lite.layers.attention import Qwen3_5Attention
from sglang_lite.layers.gdn import Qwen3_5GatedDeltaNet
from sglang_lite.layers.linear import Linear, Split, quant_block, weight_of
from sglang_lite.layers.mlp import GatedMLP, Qwen3_5SparseMoeBlock, shared_expert_fusion_supported
from sglang_lite.layers.norm import GemmaRMSNorm
from sglang_lite.layers.rotary import RotaryEmbedding
from sglang_lite.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.models.full_forward import full_forward
from sglang_lite.models.one_call import OneCallLayers
from sglang_lite.server_args import ServerArgs, server_args_or_default
from sglang_lite.streams.model_streams import ModelStreams

__all__ = [
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5MTP",
    "Qwen3_5GatedDeltaNet",
    "Qwen3_5Attention",
    "Qwen3_5SparseMoeBlock",
]


class Qwen3_5DecoderLayer(nn.Module):
    """One decoder layer; ``layer_type`` (default: the config's for ``layer_id``) lets the MTP head build its
    full-attention layer after the model's last."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        fuse_shared_expert: bool,
        layer_type: str | None = None,
    ) -> None:
        super().__init__()
        layer_type = layer_type or config.layer_types[layer_id]
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        if layer_type == "linear_attention":
            self.linear_attn = Qwen3_5GatedDeltaNet(config, layer_id)
        else:
            self.self_attn = Qwen3_5Attention(config, layer_id, rotary)
        self.mixer_name = "linear_attn" if layer_type == "linear_attention" else "self_attn"
        self.blocks_ready = False  # prepare_decode_blocks: the C++ blocks hold this layer's weights
        if config.is_moe:
            self.mlp = Qwen3_5SparseMoeBlock(config, fuse_shared_expert)
        else:
            state = get_parallel_state()
            shard_size(config.intermediate_size, state.world_size, "intermediate_size")
            self.mlp = GatedMLP(
                config.hidden_size, config.intermediate_size, Split(state.rank, state.world_size)
            )

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mixer = getattr(self, self.mixer_name)
        # the C++ blocks (decode_blocks.py) run this forward's layers (more tokens: the modules, the MoE chunked)
        blocks = self.blocks_ready and batch.dp_tokens is None and len(hidden) <= MOE_CHUNK_TOKENS
        if blocks and mixer.takes_prefill_block(batch):  # the input norm and the mixer: one call
            hidden, residual = mixer.decode_block(hidden, residual, batch, cpu_kernels.bf16_dot())
        elif residual is None:
            residual, hidden = hidden, mixer(self.input_layernorm(hidden), batch)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
            hidden = mixer(hidden, batch)
        if blocks:
            hidden, residual = self.mlp.decode_block(hidden, residual, cpu_kernels.bf16_dot())
            return world_all_reduce(hidden), residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.run_mlp(hidden, batch), residual

    def prepare_decode_blocks(self) -> None:
        """Readies the blocks (``decode_blocks``, and a prefill's in ``forward``) with the weights as laid out now."""
        getattr(self, self.mixer_name).prepare_decode_block(self.input_layernorm)
        self.mlp.prepare_decode_block(self.post_attention_layernorm)
        self.blocks_ready = True

    def decode_blocks(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        bf16_dot: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` of a decode batch as two C++ calls (the mixer's block, the MLP's: ``kernels/cpu/blocks.py``)."""
        hidden, residual = getattr(self, self.mixer_name).decode_block(
            hidden, residual, batch, bf16_dot
        )
        hidden, residual = self.mlp.decode_block(hidden, residual, bf16_dot)
        return world_all_reduce(hidden), residual

    def add_decode_blocks(self, layers: cpu_kernels.DecodeLayers, pools: ModelPools) -> None:
        """``decode_blocks``, into a whole model's ``layers`` (one rank: no reduction)."""
        getattr(self, self.mixer_name).add_decode_block(layers, pools)
        self.mlp.add_decode_block(layers)

    def run_mlp(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The MLP summed over the ranks that share it: all of this rank's world."""
        if batch.dp_tokens is None:
            return world_all_reduce(self.mlp(hidden, batch.overlap))
        return batch.dp_tokens.scatter(self.mlp(batch.dp_tokens.gather(hidden), batch.overlap))


class Qwen3_5Model(nn.Module):
    def __init__(self, config: ModelConfig, fuse_shared_expert: bool = False) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(
            config.rotary_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.vision.mrope_section if config.vision is not None else None,
        )
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(config, i, self.rotary_emb, fuse_shared_expert)
            for i in range(config.num_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # set by the runner on the CPU (model_executor/decode_blocks.py)
        self.use_decode_blocks = False
        self._decode_layers = OneCallLayers(self.layers)

    def decode_layers(self, pools: ModelPools) -> cpu_kernels.DecodeLayers | None:
        """Every layer's decode blocks as one C++ call over ``pools`` (``OneCallLayers``)."""
        return self._decode_layers.get(pools)

    def attach_lm_head(self, lm_head: nn.Module) -> None:
        """The LM head ``decode_logits`` ends with (the causal LM's)."""
        self._decode_layers.ends = (self.embed_tokens, self.norm, lm_head)
        self._decode_layers.reset()

    def one_call(self, batch: ForwardBatch, decode: bool = True) -> cpu_kernels.DecodeLayers | None:
        """The C++ decode layers where they run ``batch`` from token ids to logits in one call: the CPU's decode
        blocks on one rank, a plain decode step (no verify rows), float32 activations, an LM head attached.
        ``decode=False``: where they hold the LM head for a prefill ``batch``'s last rows."""
        if not (self.use_decode_blocks and batch.is_decode == decode and batch.verify is None):
            return None
        if batch.num_tokens == 0 or self.norm.weight.dtype != torch.float32:
            return None
        layers = self.decode_layers(batch.pools)
        return layers if layers is not None and self._decode_layers.ends is not None else None

    def decode_logits(self, batch: ForwardBatch) -> torch.Tensor | None:
        """A decode batch's logits [B, vocab] in the one C++ call (``DecodeLayers.run_logits``: the embedding, every
        layer, the final norm and the LM head) where that call serves the batch (``one_call``); else None."""
        layers = self.one_call(batch)
        if layers is None:
            return None
        requests = (batch.req_pool_indices, batch.seq_lens_t, batch.positions, batch.out_cache_loc)
        return layers.run_logits(
            batch.input_ids, batch.state_slots, requests, cpu_kernels.bf16_dot()
        )

    def decode_greedy(
        self,
        batch: ForwardBatch,
        out_cache_loc: torch.Tensor,
        stop_ids: torch.Tensor,
        wake_fd: int = -1,
    ) -> torch.Tensor | None:
        """Greedy decode steps back to back from ``batch`` (the first) in the one call (``DecodeLayers.run_greedy``:
        ``out_cache_loc`` [steps, B], ``stop_ids`` [B, S], ``wake_fd``): tokens [steps run, B]; None where
        ``one_call`` is."""
        layers = self.one_call(batch)
        if layers is None:
            return None
        requests = (batch.req_pool_indices, batch.seq_lens_t, batch.positions)
        ids = (batch.input_ids, batch.state_slots)
        bf16_dot = cpu_kernels.bf16_dot()
        return layers.run_greedy(*ids, requests, out_cache_loc, stop_ids, bf16_dot, wake_fd=wake_fd)

    def reset_decode_layers(self) -> None:
        """Forgets the built ``decode_layers`` (the blocks gathered their weights again)."""
        self._decode_layers.reset()

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if get_parallel_state().config.dp_attention:
            batch.dp_tokens = DPTokens(batch.num_tokens, batch.input_ids.device)
        hidden, residual = self._embed(batch), None
        # DP attention, a DP rank with nothing to run: it joins every layer's MLP
        if batch.num_tokens == 0:
            for layer in self.layers:
                hidden = layer.run_mlp(hidden, batch)
            return hidden
        if self.use_decode_blocks and batch.is_decode and batch.dp_tokens is None:
            hidden, residual = self._decode_blocks(hidden, batch)
        else:
            for layer in self.layers:
                hidden, residual = layer(hidden, residual, batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def _embed(self, batch: ForwardBatch) -> torch.Tensor:
        """The batch's token embeddings in the norms' dtype (the embedding may be stored narrower: bf16 weights on
        the CPU); image tokens (ids above the vocabulary) take the vision tower's rows instead."""
        if batch.image_rows is None:
            return self.embed_tokens(batch.input_ids).to(self.norm.weight.dtype)
        ids = batch.input_ids.clone()
        ids[batch.image_rows] = 0
        hidden = self.embed_tokens(ids).to(self.norm.weight.dtype)
        hidden[batch.image_rows] = batch.image_embeds.to(hidden.dtype)
        return hidden

    def _decode_blocks(
        self, hidden: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode batch through the C++ blocks: every layer in one call on one rank, a call per block where
        ranks reduce between them. A verify forward's rows (``batch.verify``) step each request's tokens in order
        through the one call, and through the modules under tensor parallelism."""
        bf16_dot = cpu_kernels.bf16_dot()
        layers = self.decode_layers(batch.pools)
        requests = (batch.req_pool_indices, batch.seq_lens_t, batch.positions, batch.out_cache_loc)
        verify, residual = batch.verify, None
        if layers is not None and verify is not None:
            states = (verify.conv, verify.ssm)
            return layers.run_verify(
                hidden, batch.state_slots, requests, bf16_dot, verify.steps, states
            )
        if layers is not None:
            return layers.run(hidden, batch.state_slots, requests, bf16_dot)
        for layer in self.layers:
            if verify is not None:
                hidden, residual = layer(hidden, residual, batch)
            else:
                hidden, residual = layer.decode_blocks(hidden, residual, batch, bf16_dot)
        return hidden, residual


class Qwen3_5ForCausalLM(nn.Module):
    """Qwen3.5 with a dense MLP. ``model(input_ids)`` for a plain causal forward; ``forward_batch`` for serving.

    Building it reads the stream flags (``sglang_lite.envs``) and the server arguments (``server_args`` when given,
    else the global ones when set, else defaults) once: they fix shared-expert fusion and the alt-stream plan of this
    instance. Build it on its target device (``load_model`` does): the platform is taken from there.
    """

    def __init__(
        self, config: ModelConfig, server_args: ServerArgs | None = None, with_mtp: bool = False
    ) -> None:
        """``with_mtp``: also build the multi-token-prediction head as ``self.mtp`` (its weights are the
        checkpoint's ``mtp.*`` tensors); the config must declare one."""
        super().__init__()
        self.config = config
        args = server_args if server_args is not None else server_args_or_default()
        fusion_supported, blocker = shared_expert_fusion_supported(
            config, quantization_config_in_use(config, args.quantization)
        )
        self.streams = ModelStreams.build(
            torch.get_default_device(), args, config.is_moe, fusion_supported, blocker
        )
        self.model = Qwen3_5Model(config, self.streams.shared_experts_fusion)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.model.attach_lm_head(self.lm_head)
        if with_mtp:
            if config.mtp_num_hidden_layers != 1:
                raise ValueError(
                    f"the checkpoint declares {config.mtp_num_hidden_layers} MTP layers "
                    "(mtp_num_hidden_layers); speculation needs a head of exactly 1"
                )
            self.mtp = Qwen3_5MTP(
                config,
                self.model.embed_tokens,
                self.model.rotary_emb,
                self.streams.shared_experts_fusion,
            )

    @property
    def compute_dtype(self) -> torch.dtype:
        """The activations' dtype (and the pools'): the norms', whatever dtype the projections' weights are kept in."""
        return self.model.norm.weight.dtype

    @torch.no_grad()
    def forward_batch(
        self,
        batch: ForwardBatch,
        all_logits: bool = False,
        body: Callable[[ForwardBatch], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits [B, vocab] of each request's last new token, or [T, vocab] of every token with ``all_logits``.

        ``body`` replaces ``self.model`` for this forward (a compiled copy of it, for instance). A decode batch on
        the CPU runs as one C++ call (``Qwen3_5Model.decode_logits``) where it can.
        """
        logits = self.model.decode_logits(batch) if body is None else None
        if logits is not None:
            return logits
        hidden = self.forward_hidden(batch, body)
        if batch.num_tokens == 0:
            return hidden.new_empty((0, self.config.vocab_size))
        if not all_logits and not batch.is_decode:  # decode: one token a request, every one a last
            hidden = hidden[batch.last_token_indices]
        return self.lm_head(hidden)

    @torch.no_grad()
    def extend_greedy(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Each request's argmax token after a prefill ``batch`` (its last new token's logits), where the CPU's one
        decode call holds the LM head: through its greedy screen (``DecodeLayers.head_argmax``); else None."""
        layers = self.model.one_call(batch, decode=False)
        if layers is None or batch.num_tokens == 0:
            return None
        hidden = self.forward_hidden(batch)[batch.last_token_indices]
        return layers.head_argmax(hidden, cpu_kernels.bf16_dot())

    @torch.no_grad()
    def forward_hidden(
        self, batch: ForwardBatch, body: Callable[[ForwardBatch], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The final norm's output [T, hidden] of every new token (what the MTP head and ``logits`` take)."""
        # the ``auto`` choice is per decode size
        captured_size = batch.batch_size if batch.is_decode else None
        batch.overlap = self.streams.context(batch.capturing, batch.num_tokens, captured_size)
        return (self.model if body is None else body)(batch)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] through the LM head (shared by the MTP head)."""
        return self.lm_head(hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Full causal forward without a cache: input_ids [B, T] -> logits [B, T, vocab]; with a VL checkpoint's
        vision tower, the images of its placeholders too (``models/full_forward.py``)."""
        return full_forward(self, input_ids, pixel_values, image_grid_thw)


class Qwen3_5MTP(nn.Module):
    """The multi-token-prediction head: the embedding of the next token and the main model's last hidden state of
    the position before it, each RMS-normed, concatenated [embedding | hidden] and projected 2H -> H (``fc``), one
    full-attention decoder layer (the MoE block in MoE models) and a final norm; the main LM head gives its
    logits, and its output is the hidden state of the next chained draft step. The embedding and the rotary table
    are the main model's; its layer is numbered after the main model's last (its own KV in the pools)."""

    def __init__(
        self,
        config: ModelConfig,
        embed_tokens: VocabParallelEmbedding,
        rotary: RotaryEmbedding,
        fuse_shared_expert: bool,
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self._embed = (
            embed_tokens,
        )  # the main model's (a tuple keeps it out of this module's children)
        self.pre_fc_norm_embedding = GemmaRMSNorm(hidden, config.rms_norm_eps)
        self.pre_fc_norm_hidden = GemmaRMSNorm(hidden, config.rms_norm_eps)
        self.fc = Linear(2 * hidden, hidden)
        self.layers = nn.ModuleList(
            [
                Qwen3_5DecoderLayer(
                    config, config.num_layers, rotary, fuse_shared_expert, "full_attention"
                )
            ]
        )
        self.norm = GemmaRMSNorm(hidden, config.rms_norm_eps)
        self.use_decode_blocks = False  # set by the runner on the CPU, as the main model's
        self._decode_layers = OneCallLayers(self.layers)

    @property
    def layer_id(self) -> int:
        return self.layers[0].self_attn.layer_id

    def prepare_decode_blocks(self) -> None:
        """Gathers what the decode blocks read (the runner calls this after ``weight_layout``): its decoder
        layer's, and the input's norms and ``fc`` as they are laid out now."""
        self.layers[0].prepare_decode_blocks()
        self._decode_layers.reset()
        norms = (self.pre_fc_norm_embedding, self.pre_fc_norm_hidden)
        self._decode_input = (
            tuple(cpu_kernels.Norm(norm.weight, norm.eps) for norm in norms),
            weight_of(self.fc),
            quant_block(self.fc),
        )

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """``batch.input_ids`` the tokens after the positions whose main hidden states are ``hidden`` [T, H]:
        the head's hidden state [T, H] at those positions (its KV written at ``batch.out_cache_loc``). Decode
        batches (a chain step, the kept tokens' rows) run as C++ calls where the main model's layers do: the
        input, then the decoder layer."""
        embedded = self._embed[0](batch.input_ids).to(hidden.dtype)
        layers = None
        if self.use_decode_blocks and batch.is_decode:
            layers = self._decode_layers.get(batch.pools)
        if layers is not None:
            bf16_dot = cpu_kernels.bf16_dot()
            joined = cpu_kernels.mtp_input_block(embedded, hidden, *self._decode_input, bf16_dot)
            requests = (
                batch.req_pool_indices,
                batch.seq_lens_t,
                batch.positions,
                batch.out_cache_loc,
            )
            out, residual = layers.run(joined, batch.state_slots, requests, bf16_dot)
        else:
            joined = torch.cat(
                [self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], dim=-1
            )
            out, residual = self.layers[0](self.fc(joined), None, batch)
        out, _ = self.norm(out, residual)
        return out


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5 with sparse MoE blocks (softmax top-k routing plus a sigmoid-gated shared expert)."""


def model_class_for(config: ModelConfig) -> type[Qwen3_5ForCausalLM]:
    return Qwen3_5MoeForCausalLM if config.is_moe else Qwen3_5ForCausalLM
