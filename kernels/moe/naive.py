"""Plain-PyTorch fused MoE; also the CPU path. Rows are grouped by expert and run as one batched GEMM per
projection over experts padded to a common size, plus one GEMM per overloaded expert (few ops: on the CPU the
per-op cost, not the arithmetic, is what a per-expert loop pays for). One token (decode at batch 1) runs its k
experts one by one; a few tokens over small experts run every expert on every token (fewer ops still).

Layouts: x [T, H]; w13 [E, 2I, H] (first I rows gate, next I up); w2 [E, H, I]; topk_weights [T, k] (fp32);
topk_ids [T, k]. The shared expert can ride along as an extra expert id with its own per-token weight.
"""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F
from einops import rearrange

from ..quant import mxfp4
from ..quant import naive as quant


def topk_softmax(
    router_logits: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in fp32, keep the top k, optionally renormalise them to sum to 1."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.to(torch.int32)


def moe_route(
    router_logits: torch.Tensor,
    shared_logits: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    shared_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_softmax``, then with ``shared_logits`` [T, 1] one more column per token: the fused shared expert, id
    ``shared_id``, weight sigmoid(shared logit)."""
    return append_shared_expert(
        *topk_softmax(router_logits, top_k, renormalize), shared_logits, shared_id
    )


def append_shared_expert(
    weights: torch.Tensor, ids: torch.Tensor, shared_logits: torch.Tensor | None, shared_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights and ids [T, k] with the fused shared expert's column appended (when ``shared_logits``)."""
    if shared_logits is None:
        return weights, ids
    shared_weight = torch.sigmoid(shared_logits.float())
    shared = torch.full_like(ids[:, :1], shared_id)
    return torch.cat([weights, shared_weight], dim=1), torch.cat([ids, shared], dim=1)


# What one more GEMM call costs, in multiply-adds one CPU core would do meanwhile (measured: docs/performance.md).
_GEMM_CALL_MACS = 500_000


# Reading one expert's weights costs about as much as running this many rows through it: the weights come from
# memory, a row's work from cache (measured: docs/performance.md).
_WEIGHT_READ_ROWS = 32


def _dense_pays(num_tokens: int, unselected: int, row_macs: int) -> bool:
    """Whether every expert running every token beats grouping: the work the ``unselected`` experts per token
    waste, weight reads included, stays below the ~20 op calls grouping adds. Only for small experts and few
    tokens: at the tiny model's shape (H 128, I 64, 8 experts top-2) up to a few dozen tokens; at H 256 with 16
    experts top-4 grouping won from 2 tokens on (docs/performance.md)."""
    return unselected * (num_tokens + _WEIGHT_READ_ROWS) * row_macs <= 24 * _GEMM_CALL_MACS


def _capacity(counts: list[int], row_macs: int) -> int:
    """Rows per expert in the padded batched GEMM: the largest load up to twice the mean load of the experts hit.

    Heavier experts (a fused shared expert sees every token) overflow into their own GEMMs. Returns 0 (no batched
    GEMM, one GEMM per expert hit) when padding every expert to that size would waste over a third of the work,
    as with a few tokens spread over many experts, or, on one thread, when the padding rows (``row_macs``
    multiply-adds each) cost more than the two GEMM calls per expert they save. With more threads the batched GEMM
    spreads experts over threads, which per-expert GEMMs of a few dozen rows do not: there it won at every size
    measured, while on one thread exact GEMMs won from H=512 (docs/performance.md).
    """
    hit = [c for c in counts if c]
    if not hit:
        return 0
    limit = 2 * sum(hit) / len(hit)
    capacity = max(c for c in hit if c <= limit)
    useful = sum(min(c, capacity) for c in counts)
    padding = len(counts) * capacity - useful
    if 3 * padding > len(counts) * capacity:
        return 0
    if torch.get_num_threads() == 1 and padding * row_macs > 2 * len(hit) * _GEMM_CALL_MACS:
        return 0
    return capacity


def _layout(
    sorted_ids: torch.Tensor, counts: list[int], capacity: int
) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Buffer row of every expert-sorted row: the first ``capacity`` rows of expert e go to e * capacity + rank
    (the padded [E, capacity] block), the rest to an overflow region after it. Also the overflow (expert, begin,
    end) ranges, in buffer rows."""
    num_experts = len(counts)
    overflow = [max(c - capacity, 0) for c in counts]
    ovf_starts = list(accumulate(overflow[:-1], initial=num_experts * capacity))
    ranges = [(e, ovf_starts[e], ovf_starts[e] + n) for e, n in enumerate(overflow) if n]
    device = sorted_ids.device
    starts = torch.tensor([0] + counts[:-1], device=device).cumsum(0)
    experts = sorted_ids.long()
    rank = torch.arange(experts.numel(), device=device) - starts[experts]
    ovf = torch.tensor(ovf_starts, device=device)[experts] + rank - capacity
    return torch.where(rank < capacity, experts * capacity + rank, ovf), ranges


def _grouped_mm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, capacity: int, ranges) -> None:
    """out = a @ w[e]^T per expert: one bmm over the padded block, one mm per overflow range."""
    padded = w.shape[0] * capacity
    if capacity:
        torch.bmm(
            a[:padded].view(w.shape[0], capacity, -1),
            w.transpose(1, 2),
            out=out[:padded].view(w.shape[0], capacity, -1),
        )
    for expert, begin, end in ranges:
        torch.mm(a[begin:end], w[expert].t(), out=out[begin:end])


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``sum_i w_i * down_e(silu(gate_e(x)) * up_e(x))`` over each token's selected experts."""
    num_tokens, top_k = topk_ids.shape
    inter = w2.shape[2]
    # no host read: one graph for the whole step
    if torch.compiler.is_compiling() and num_tokens <= 64:
        return _fused_moe_dense(x, w13, w2, topk_weights, topk_ids)
    if num_tokens == 1:
        return _fused_moe_one_token(x, w13, w2, topk_weights, topk_ids)
    if _dense_pays(num_tokens, w13.shape[0] - top_k, 3 * x.shape[1] * inter):
        return _fused_moe_dense(x, w13, w2, topk_weights, topk_ids)
    flat_ids = topk_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # the one host read
    # gate_up and down multiply-adds of one row
    capacity = _capacity(counts, 3 * x.shape[1] * inter)
    pos, ranges = _layout(sorted_ids, counts, capacity)
    num_buffer_rows = w13.shape[0] * capacity + sum(end - begin for _, begin, end in ranges)
    # token of every buffer row; padding rows compute token 0 and are never read back
    token_of = torch.zeros(num_buffer_rows, dtype=torch.long, device=x.device)
    token_of[pos] = order // top_k
    gate_up = x.new_empty(num_buffer_rows, 2 * inter)
    _grouped_mm(x.index_select(0, token_of), w13, gate_up, capacity, ranges)
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    expert_out = x.new_empty(num_buffer_rows, w2.shape[1])
    _grouped_mm(act, w2, expert_out, capacity, ranges)
    # (token, slot) order, then the weighted sum over slots (cheaper than an index_add_ scatter)
    buffer_row = torch.empty_like(pos)
    buffer_row[order] = pos
    rows = rearrange(expert_out.index_select(0, buffer_row), "(t k) h -> t k h", k=top_k).float()
    return _weighted_sum(rows, topk_weights).to(x.dtype)


def _weighted_sum(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_j weights[:, j] * rows[:, j]`` in fp32 for rows [T, k, H]: k multiply-adds over [T, H]. The same sum
    as a [T, 1, k] x [T, k, H] bmm was several times slower on the CPU (docs/performance.md)."""
    weights = weights.float()
    out = rows[:, 0] * weights[:, :1]
    for j in range(1, rows.shape[1]):
        out.addcmul_(rows[:, j], weights[:, j : j + 1])
    return out


def _fused_moe_one_token(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """One token (decode at batch 1): its k experts one after the other, straight from the weights. It reads k of
    the E experts' weights, which is what a step at batch 1 waits on (faster than every expert in one bmm;
    docs/performance.md)."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert, weight in zip(topk_ids[0].tolist(), topk_weights[0].tolist()):
        gate_up = torch.mm(x, w13[expert].t())
        act = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
        out.add_(torch.mm(act, w2[expert].t()), alpha=weight)
    return out.to(x.dtype)


def _fused_moe_dense(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Few tokens and few experts per selected one: every expert runs every token (one bmm per projection) and
    routing weights, zero where an expert was not selected, form the sum. At most 4x the arithmetic of the
    grouped path but a handful of ops, no sort and no host read: on the CPU the per-op cost dominates here."""
    num_experts, inter = w13.shape[0], w2.shape[2]
    rows = x.unsqueeze(0).expand(num_experts, -1, -1)  # [E, T, H]
    gate_up = torch.bmm(rows, w13.transpose(1, 2))  # [E, T, 2I]
    act = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    expert_out = torch.bmm(act, w2.transpose(1, 2)).float()  # [E, T, H]
    dense = topk_weights.new_zeros(x.shape[0], 1, num_experts, dtype=torch.float32)
    # [T, 1, E]
    dense.scatter_add_(2, topk_ids.long().unsqueeze(1), topk_weights.float().unsqueeze(1))
    return torch.bmm(dense, expert_out.transpose(0, 1)).squeeze(1).to(x.dtype)


def fused_moe_fp8(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    block: tuple[int, int],
) -> torch.Tensor:
    """The FP8 fused MoE's reference: x and the activation between the GEMMs quantized per token group of
    ``block[1]`` as the Triton kernels do, each selected expert dequantized in turn (float32 arithmetic)."""
    top_k, group = topk_ids.shape[1], block[1]
    flat_ids, flat_weights = topk_ids.reshape(-1), topk_weights.reshape(-1).float()
    x_dq = quant.dequantize_groups(*quant.per_token_group_quant(x, group, w13.dtype), group)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for expert in flat_ids.unique().tolist():
        pairs = (flat_ids == expert).nonzero().squeeze(1)
        tokens = pairs // top_k
        gate_up = x_dq[tokens] @ quant.dequantize_blocks(w13[expert], w13_scale[expert], block).t()
        act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
        act_dq = quant.dequantize_groups(*quant.per_token_group_quant(act, group, w2.dtype), group)
        expert_out = act_dq @ quant.dequantize_blocks(w2[expert], w2_scale[expert], block).t()
        out.index_add_(0, tokens, expert_out * flat_weights[pairs, None])
    return out.to(x.dtype)


def fused_moe_mxfp4(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    activations: str | None = None,
) -> torch.Tensor:
    """``fused_moe`` with MXFP4 experts (``kernels/quant/mxfp4.py``'s layout), dequantized exactly to float32 first;
    output in x's dtype. ``activations`` (a scale mode, W4A4): each expert's inputs, x and the gated intermediate,
    are rounded through MXFP4 per 32 columns first; None: weight-only, x is not quantized."""
    experts13 = mxfp4.dequantize(w13, w13_scale)
    experts2 = mxfp4.dequantize(w2, w2_scale)
    if activations is None:
        return fused_moe(x.float(), experts13, experts2, topk_weights, topk_ids).to(x.dtype)
    x_q = mxfp4.quantize_dequantize(x.float(), activations)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for slot in range(topk_ids.shape[1]):
        for expert in topk_ids[:, slot].unique().tolist():
            rows = (topk_ids[:, slot] == expert).nonzero().squeeze(1)
            gate, up = (x_q[rows] @ experts13[expert].t()).chunk(2, dim=-1)
            hidden = mxfp4.quantize_dequantize(F.silu(gate) * up, activations)
            weight = topk_weights[rows, slot].float().unsqueeze(1)
            out[rows] += weight * (hidden @ experts2[expert].t())
    return out.to(x.dtype)
