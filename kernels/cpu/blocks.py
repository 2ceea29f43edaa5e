"""The blocks of a decode step on the CPU, each one C++ call (``csrc/layer_ops.cpp``): a layer's input norm with its
mixer (Gated DeltaNet or gated attention), its post-attention norm with its MLP (MoE or dense).

Through the modules a decode layer is ~30 dispatched ops whose Python and dispatcher costs, at batch 1, exceed their
arithmetic; each block runs the same C++ ops back to back and computes what its modules compute, from the same
weights (float32, bf16, FP8 or MXFP4 ones, as ``kernels.linear`` takes them) and pools. Every block returns (output,
residual): the residual is the pre-norm sum the next norm adds to (``residual`` None: the layer's input is its own,
as in the first layer). Tensor-parallel reductions stay outside, between the blocks. The mixer blocks also run a
prefill's tokens (``cu_seqlens`` for the GDN block, ``extend`` for the attention block), and the MLP blocks take
any rows: a prefill layer's Python is then two calls too.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sglang_lite import envs

from .build import available

MXFP4 = "mxfp4"  # the weight_format of MXFP4 layers


class Weight(NamedTuple):
    """A projection's weight [out, in] (float32, bf16 or FP8, as ``kernels.linear`` takes it) and, for FP8, its
    block scales; or MXFP4 (uint8 [out, in / 2]) and its e8m0 scales (uint8 [out, ceil(in / 32)]), or MXFP4
    experts (uint8 [E, out, in / 2]) and theirs."""

    data: torch.Tensor
    scale: torch.Tensor | None = None

    @classmethod
    def of(cls, layer: torch.nn.Module) -> Weight:
        """A linear layer's weight with the scales a quantized one keeps beside it (its ``weight_scales``: FP8's
        block scales or MXFP4's e8m0 ones; none for a plain layer)."""
        return cls(layer.weight, getattr(layer, "weight_scales", None))

    @classmethod
    def experts_of(cls, block: torch.nn.Module) -> tuple[Weight, Weight]:
        """An MoE block's w13 and w2 with the scales a quantized block keeps beside them (its
        ``expert_tensors``)."""
        if not hasattr(block, "expert_tensors"):
            return cls(block.experts.w13), cls(block.experts.w2)
        w13, w2, w13_scale, w2_scale = block.expert_tensors()
        return cls(w13, w13_scale), cls(w2, w2_scale)


class Norm(NamedTuple):
    weight: torch.Tensor
    eps: float


class GdnHeads(NamedTuple):
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int


class AttentionHeads(NamedTuple):
    heads: int
    kv_heads: int
    head_dim: int
    scale: float


def _ops():
    return torch.ops.sglang_lite_cpu


def _block(block: tuple[int, int] | None) -> list[int]:
    return list(block) if block else []


def supported() -> bool:
    """Whether the blocks can run (the C++ kernels build)."""
    return available()


def gdn_decode_block(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    norm: Norm,
    qkvz: Weight,
    ba: Weight,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    gated_norm: Norm,
    out: Weight,
    states: tuple[torch.Tensor, torch.Tensor],
    state_slots: torch.Tensor,
    heads: GdnHeads,
    block: tuple[int, int] | None,
    bf16_dot: int,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [B, H] -> (out_proj's output [B, H], residual). ``conv_weight`` [conv_dim, K]; ``states``: the conv
    states [S, conv_dim, K-1] and recurrent states [S, HV, dk, dv] (float32, updated in place at
    ``state_slots``). ``cu_seqlens`` [R + 1]: a prefill of R requests' tokens instead (``state_slots`` [R], one a
    request), through the prefill kernels as the modules run them."""
    args = (
        hidden,
        residual,
        *norm,
        *qkvz,
        *ba,
        conv_weight,
        A_log,
        dt_bias,
        *gated_norm,
        *out,
        *states,
    )
    args += (state_slots, *heads, _block(block), bf16_dot)
    if cu_seqlens is None:
        return _ops().gdn_decode_block(*args)
    return _ops().gdn_prefill_block(*args, cu_seqlens)


def attention_decode_block(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    norm: Norm,
    qkv: Weight,
    qk_norms: tuple[torch.Tensor, torch.Tensor, float],
    o: Weight,
    rotary: tuple[torch.Tensor, int],
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    batch: tuple[torch.Tensor, ...],
    heads: AttentionHeads,
    page_size: int,
    block: tuple[int, int] | None,
    bf16_dot: int,
    extend: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [B, H] -> (o_proj's output [B, H], residual). ``qk_norms``: the q and k norm weights and their eps;
    ``rotary``: the cos/sin table [P, rotary_dim] and rotary_dim; ``kv_cache``: this layer's K and V pools (the new
    tokens written at ``out_cache_loc``); ``batch``: page_table (pages of ``page_size`` tokens), req_pool_indices,
    seq_lens, positions, out_cache_loc. ``extend`` (prefix_lens [R], extend_lens [R]): a prefill of R requests' new
    tokens instead, each attending causally to its request's cached tokens and itself (seq_lens unused; positions
    and out_cache_loc one a token)."""
    head = (hidden, residual, *norm, *qkv, *qk_norms, *o, *rotary, *kv_cache)
    tail = (*heads, page_size, _block(block), bf16_dot)
    if extend is None:
        return _ops().attention_decode_block(*head, *batch, *tail)
    page_table, rows, _, positions, out_cache_loc = batch
    requests = (page_table, rows, *extend, positions, out_cache_loc)
    return _ops().attention_prefill_block(*head, *requests, *tail)


def moe_decode_block(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    norm: Norm,
    gates: tuple[torch.Tensor, torch.Tensor],
    w13: Weight,
    w2: Weight,
    shared: tuple[Weight, Weight] | None,
    top_k: int,
    shared_id: int,
    block: tuple[int, int] | None,
    bf16_dot: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [B, H] -> (the MoE's output, residual). ``gates``: the router's and the shared expert gate's weights;
    ``shared_id`` >= 0: the shared expert is that row of the experts, else ``shared`` holds its gate_up and down."""
    gate_up, down = shared if shared is not None else (Weight(None), Weight(None))
    return _ops().moe_decode_block(
        hidden,
        residual,
        *norm,
        *gates,
        *w13,
        *w2,
        *gate_up,
        *down,
        top_k,
        shared_id,
        _block(block),
        bf16_dot,
    )


def mlp_decode_block(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    norm: Norm,
    gate_up: Weight,
    down: Weight,
    block: tuple[int, int] | None,
    bf16_dot: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [B, H] -> (down(silu(gate) * up), residual)."""
    return _ops().mlp_decode_block(
        hidden, residual, *norm, *gate_up, *down, _block(block), bf16_dot
    )


def mtp_input_block(
    embedded: torch.Tensor,
    hidden: torch.Tensor,
    norms: tuple[Norm, Norm],
    fc: Weight,
    block: tuple[int, int] | None,
    bf16_dot: int,
) -> torch.Tensor:
    """The MTP head's input [N, H]: ``fc`` of the normed embeddings and hidden states side by side (``norms``:
    the embeddings', the hidden states')."""
    return _ops().mtp_input_block(
        embedded, hidden, *norms[0], *norms[1], *fc, _block(block), bf16_dot
    )


class DecodeLayers:
    """Every block of a model's decode step in one C++ call (``csrc/layer_ops.cpp``'s ``DecodeLayers``): each
    block's arguments that stay the same from step to step (weights, norms, heads, its layer's pools) are given
    once, in the order the blocks run, as the block functions above take them; ``run`` passes what a step changes.
    No tensor-parallel reduction is made between the blocks: for a model that one rank runs whole."""

    def __init__(self) -> None:
        self._layers = torch.classes.sglang_lite_cpu.DecodeLayers()
        # SGLANG_CPU_BF16_PLANES unset: where this build's decode of the planes pays (AVX-512)
        planes = envs.SGLANG_CPU_BF16_PLANES.get()
        self._layers.set_bf16_planes(_ops().bf16_planes_pay() if planes is None else planes)

    @property
    def bf16_planes_bytes(self) -> int:
        """The bytes of the 12-bit copies kept of the blocks' bf16 projections (``SGLANG_CPU_BF16_PLANES``)."""
        return self._layers.bf16_planes_bytes()

    def __len__(self) -> int:
        return self._layers.size()

    def add_gdn(
        self,
        norm: Norm,
        qkvz: Weight,
        ba: Weight,
        conv_weight: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        gated_norm: Norm,
        out: Weight,
        states: tuple[torch.Tensor, torch.Tensor],
        heads: GdnHeads,
        block: tuple[int, int] | None,
        state_layer: int,
    ) -> None:
        """``state_layer``: the layer's index among the Gated DeltaNet layers (its place in a slot's states)."""
        self._layers.add_gdn(
            *norm,
            *qkvz,
            *ba,
            conv_weight,
            A_log,
            dt_bias,
            *gated_norm,
            *out,
            *states,
            *heads,
            _block(block),
            state_layer,
        )

    def add_attention(
        self,
        norm: Norm,
        qkv: Weight,
        qk_norms: tuple[torch.Tensor, torch.Tensor, float],
        o: Weight,
        rotary: tuple[torch.Tensor, int],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        page_table: torch.Tensor,
        heads: AttentionHeads,
        page_size: int,
        block: tuple[int, int] | None,
    ) -> None:
        self._layers.add_attention(
            *norm,
            *qkv,
            *qk_norms,
            *o,
            *rotary,
            *kv_cache,
            page_table,
            *heads,
            page_size,
            _block(block),
        )

    def add_moe(
        self,
        norm: Norm,
        gates: tuple[torch.Tensor, torch.Tensor],
        w13: Weight,
        w2: Weight,
        shared: tuple[Weight, Weight] | None,
        top_k: int,
        shared_id: int,
        block: tuple[int, int] | None,
    ) -> None:
        gate_up, down = shared if shared is not None else (Weight(None), Weight(None))
        self._layers.add_moe(
            *norm, *gates, *w13, *w2, *gate_up, *down, top_k, shared_id, _block(block)
        )

    def add_mlp(
        self, norm: Norm, gate_up: Weight, down: Weight, block: tuple[int, int] | None
    ) -> None:
        self._layers.add_mlp(*norm, *gate_up, *down, _block(block))

    def set_ends(self, embedding: torch.Tensor, norm: Norm, lm_head: Weight) -> None:
        """The step's two ends, for ``run_logits``: the embedding [V, H], the final norm and the LM head."""
        self._layers.set_ends(embedding, *norm, *lm_head)

    def run_logits(
        self,
        input_ids: torch.Tensor,
        state_slots: torch.Tensor,
        requests: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        bf16_dot: int,
    ) -> torch.Tensor:
        """input_ids [B] -> logits [B, V]: the embedding's rows through ``run``, the final norm and the LM head
        (``set_ends``), in the one call."""
        return self._layers.run_logits(input_ids, state_slots, *requests, bf16_dot)

    def run_greedy(
        self,
        input_ids: torch.Tensor,
        state_slots: torch.Tensor,
        requests: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        out_cache_loc: torch.Tensor,
        stop_ids: torch.Tensor,
        bf16_dot: int,
        greedy_head: bool | None = None,
        wake_fd: int = -1,
    ) -> torch.Tensor:
        """Greedy decode steps back to back in the one call, each ``run_logits`` then the argmax of each row
        (``argmax_rows``): input_ids [B] -> tokens [steps run, B]. ``requests``: req_pool_indices, seq_lens and
        positions of the first step (each later step one further); ``out_cache_loc`` [steps, B]: each step's KV
        slots. The run ends after a step in which a row's token is one of its ``stop_ids`` [B, S] (int64, -1 where
        a row has fewer), or after a step at whose end the file descriptor ``wake_fd`` (-1: none) is readable (the
        scheduler's command inbox: a request arrived). ``greedy_head``: at batch 1, each step's argmax through an
        int8 copy of a float32 or bf16 LM head and the exact logits of the rows that can be the maximum
        (``csrc/greedy_head.h``: the same tokens), the whole head where that cannot decide; False: the whole head
        every step; None: ``SGLANG_CPU_GREEDY_HEAD`` (read every call)."""
        if greedy_head is None:
            greedy_head = bool(envs.SGLANG_CPU_GREEDY_HEAD.get())
        return self._layers.run_greedy(
            input_ids,
            state_slots,
            *requests,
            out_cache_loc,
            stop_ids,
            bf16_dot,
            greedy_head,
            wake_fd,
        )

    def head_argmax(
        self, normed: torch.Tensor, bf16_dot: int, greedy_head: bool | None = None
    ) -> torch.Tensor:
        """Each row's argmax of the LM head's logits (``set_ends``) for float32 rows after the final norm [B, H] (a
        prefill's last tokens): int64 [B], found as ``run_greedy`` finds a step's (``greedy_head`` likewise)."""
        if greedy_head is None:
            greedy_head = bool(envs.SGLANG_CPU_GREEDY_HEAD.get())
        return self._layers.head_argmax(normed.contiguous(), bf16_dot, greedy_head)

    def run(
        self,
        hidden: torch.Tensor,
        state_slots: torch.Tensor,
        requests: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        bf16_dot: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, H] (the embeddings) -> (the last block's output, residual). ``requests``: req_pool_indices,
        seq_lens, positions, out_cache_loc."""
        return self._layers.run(hidden, state_slots, *requests, bf16_dot)

    def run_verify(
        self,
        hidden: torch.Tensor,
        state_slots: torch.Tensor,
        requests: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        bf16_dot: int,
        steps: list[tuple[torch.Tensor, torch.Tensor]],
        states: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``run`` over a speculative verify forward's rows (one a token, each with its request's state slot): the
        Gated DeltaNet layers step each request's tokens in order (``steps[j]``: the rows of token j and their
        requests) and keep the states after each in ``states`` (conv [R, T, layers, conv_dim, K-1], ssm [R, T,
        layers, HV, dk, dv]: ``sglang_lite.forward_batch.VerifyStates``)."""
        rows = [tokens for tokens, _ in steps]
        reqs = [requests_of_step for _, requests_of_step in steps]
        return self._layers.run_verify(
            hidden, state_slots, *requests, bf16_dot, rows, reqs, *states
        )
