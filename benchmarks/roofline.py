"""The machine's limits, measured, and the work of one forward, counted from the model's shape.

``measure_machine`` times a large fp32 GEMM (the GEMM peak) and a large copy (the memory bandwidth) at the
current thread count. ``prefill_work`` and ``decode_work`` count the FLOPs and bytes of one forward from a
``ModelConfig``: every projection, expert, attention and gated-delta-rule multiply-add (2 FLOPs each), and the
bytes a forward cannot avoid moving: each weight it touches read once (for routed experts, the experts a batch of
that size is expected to hit), the GDN states read and written, the KV cache read, and in prefill every GEMM's
input read and output written once (the activations). Norms, gates and other elementwise work are left out: they
are small beside the GEMMs in FLOPs, and the bytes above already bound their traffic from below.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sglang_lite.config import ModelConfig

FP32 = 4


@dataclass(frozen=True)
class Machine:
    gemm_gflops: float  # fp32 GEMM, 2048^3
    bandwidth_gbs: float  # bytes read + written per second by a 256 MB copy


@dataclass(frozen=True)
class Work:
    flops: float
    bytes: float

    def shares(self, seconds: float, machine: Machine) -> tuple[float, float]:
        """Fraction of the GEMM peak and of the memory bandwidth that doing this work in ``seconds`` uses."""
        return (
            self.flops / seconds / 1e9 / machine.gemm_gflops,
            self.bytes / seconds / 1e9 / machine.bandwidth_gbs,
        )


def measure_machine(repeats: int = 5) -> Machine:
    """Best of ``repeats`` (a shared host only ever slows a run down)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    gemm = _best_seconds(lambda: torch.mm(a, b), repeats)
    src = torch.randn(64 * 1024 * 1024)  # 256 MB: far beyond any cache
    dst = torch.empty_like(src)
    copy = _best_seconds(lambda: dst.copy_(src), repeats)
    return Machine(2 * 2048**3 / gemm / 1e9, 2 * src.numel() * FP32 / copy / 1e9)


def _best_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _layer_weights(c: ModelConfig, kind: str) -> int:
    """Parameters of one layer's mixer (projections only)."""
    h = c.hidden_size
    if kind == "linear_attention":
        return (
            h * (c.conv_dim + c.linear_value_dim + 2 * c.linear_num_value_heads)
            + c.linear_value_dim * h
        )
    q = c.num_attention_heads * c.head_dim
    return h * (2 * q + 2 * c.num_key_value_heads * c.head_dim) + q * h


def _expert_weights(c: ModelConfig) -> int:
    return 3 * c.hidden_size * (c.moe_intermediate_size if c.is_moe else c.intermediate_size)


def _experts_hit(c: ModelConfig, tokens: int) -> float:
    """Expected routed experts a batch of ``tokens`` selects (uniform routing), plus the shared one."""
    if not c.is_moe:
        return 1.0
    e, k = c.num_experts, c.num_experts_per_tok
    return e * (1 - (1 - k / e) ** tokens) + (c.shared_expert_intermediate_size > 0)


def _mlp_active(c: ModelConfig) -> float:
    """Expert (or dense MLP) parameters one token runs through."""
    if not c.is_moe:
        return _expert_weights(c)
    shared = 3 * c.hidden_size * c.shared_expert_intermediate_size
    return c.num_experts_per_tok * _expert_weights(c) + shared + c.hidden_size * c.num_experts


def _gdn_state_elems(c: ModelConfig) -> int:
    return c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim


def _mixer_weights(c: ModelConfig) -> int:
    return sum(_layer_weights(c, kind) for kind in c.layer_types)


def _weights_read(c: ModelConfig, tokens: int) -> float:
    """Parameters a forward over ``tokens`` tokens reads: mixers, the experts it hits, the LM head."""
    experts = _experts_hit(c, tokens) * (_expert_weights(c) if c.is_moe else 1)
    if c.is_moe:
        experts += c.hidden_size * c.num_experts
    return _mixer_weights(c) + c.num_layers * experts + c.vocab_size * c.hidden_size


def prefill_work(c: ModelConfig, batch: int, length: int) -> Work:
    """``batch`` prompts of ``length`` tokens in one forward, logits of each prompt's last token."""
    tokens = batch * length
    gemm = (
        tokens * (_mixer_weights(c) + c.num_layers * _mlp_active(c))
        + batch * c.vocab_size * c.hidden_size
    )
    # causal
    attention = (
        len(c.full_attention_layers) * batch * length**2 * c.num_attention_heads * c.head_dim
    )
    chunk = 32  # the CPU path's chunk: per token and value head, the state reads and writes plus the chunk's pairs
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    gdn = (
        len(c.linear_attention_layers)
        * tokens
        * c.linear_num_value_heads
        * (3 * dk * dv + chunk * (dk + dv))
    )
    activations = tokens * FP32 * c.num_layers * 2 * (c.hidden_size + _activation_width(c))
    return Work(2 * (gemm + attention + gdn), FP32 * _weights_read(c, tokens) + activations)


def _activation_width(c: ModelConfig) -> float:
    """Per token and layer, the widths of the GEMM inputs and outputs besides the hidden state (averaged over
    the layer types): mixer projections, and the expert rows the MoE gathers and produces."""
    mixers = (
        sum(
            c.conv_dim + 2 * c.linear_value_dim
            if kind == "linear_attention"
            else 3 * c.num_attention_heads * c.head_dim + 2 * c.num_key_value_heads * c.head_dim
            for kind in c.layer_types
        )
        / c.num_layers
    )
    inter = c.moe_intermediate_size if c.is_moe else c.intermediate_size
    rows = c.num_experts_per_tok + (c.shared_expert_intermediate_size > 0) if c.is_moe else 1
    return mixers + rows * (2 * c.hidden_size + 3 * inter)


def decode_work(c: ModelConfig, batch: int, context: int) -> Work:
    """One decode step of ``batch`` requests, each with ``context`` tokens cached."""
    gemm = batch * (
        _mixer_weights(c) + c.num_layers * _mlp_active(c) + c.vocab_size * c.hidden_size
    )
    kv = c.num_key_value_heads * c.head_dim
    attention = (
        len(c.full_attention_layers) * batch * context * 2 * c.num_attention_heads * c.head_dim
    )
    states = len(c.linear_attention_layers) * batch * _gdn_state_elems(c)
    kv_bytes = len(c.full_attention_layers) * batch * context * 2 * kv * FP32
    flops = 2 * (gemm + attention + 3 * states)
    return Work(flops, FP32 * _weights_read(c, batch) + 2 * FP32 * states + kv_bytes)
