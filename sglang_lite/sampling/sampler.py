"""Batched next-token sampling with per-request temperature, top-k, top-p, min-p and random generator.

Greedy rows take the argmax. Sampled rows filter the sorted distribution (top-k, then top-p on the cumulative
mass, then min-p relative to the most likely token; only the CANDIDATES likeliest tokens are sorted where the
filters end among them) and draw with the request's own ``torch.Generator`` (``draw``: a uniform draw against the
cumulative weights), so a seeded request gives the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import math

import torch

from sglang_lite.kernels import cpu
from sglang_lite.kernels.dispatch import use_native
from sglang_lite.sampling.params import SamplingParams


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    banned: list[list[int]] | None = None,
) -> torch.Tensor:
    """logits [B, V] -> next token ids [B] (int64). ``banned[i]`` are ids request i may not produce now."""
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators), (
        "one row per request"
    )
    if all(p.is_greedy for p in params) and not (banned and any(banned)):
        return argmax_rows(logits)  # the argmax is the same in the logits' dtype as in fp32
    logits = logits.float()
    if banned and any(banned):
        logits = _ban(logits.clone(), banned)
    next_ids = argmax_rows(logits)
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        drawn = _sample_rows(
            logits[index], [params[i] for i in rows], [generators[i] for i in rows]
        )
        next_ids[index] = drawn
    return next_ids


# Columns per block of the CPU argmax below.
_ARGMAX_BLOCK = 256


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of [B, V] logits: the first index of each row's maximum, NaN counting as the
    maximum, as torch's.

    On the CPU torch's argmax over a long last dimension is not vectorised (``amax`` is): float32 logits go to the
    C++ kernel (one vectorised pass for the maximum, one to its first index: one call in place of the ~10 small ops
    below, which a decode step at batch 1 feels). Without it each row's maximum is found by blocks with ``amax``,
    and the argmax runs only within the first block that holds it: faster from a few rows on, and even with
    torch's at one row of a small vocabulary (``benchmarks/bench_greedy_argmax.py``; the figures:
    docs/performance.md)."""
    if use_native(logits):
        return cpu.argmax_rows(logits)
    rows, vocab = logits.shape
    block = _ARGMAX_BLOCK
    if logits.device.type != "cpu" or vocab < 4 * block or logits.stride(-1) != 1:
        return logits.argmax(dim=-1)
    full = vocab - vocab % block
    block_max = logits[:, :full].reshape(rows, full // block, block).amax(dim=-1)
    if full < vocab:
        block_max = torch.cat([block_max, logits[:, full:].amax(dim=-1, keepdim=True)], dim=1)
    first = block_max.argmax(dim=-1)  # the first block holding the row's maximum (or its first NaN)
    # that block's columns; a short last block repeats the last column after it, which argmax never returns first
    cols = (first.unsqueeze(1) * block + torch.arange(block, device=logits.device)).clamp_(
        max=vocab - 1
    )
    return first * block + logits.gather(1, cols).argmax(dim=-1)


def _ban(logits: torch.Tensor, banned: list[list[int]]) -> torch.Tensor:
    for row, ids in enumerate(banned):
        if ids:
            logits[row, ids] = float("-inf")
    return logits


# Tokens a row's filters are first applied among (the most likely, by ``topk``): a row whose top-k, top-p or min-p
# already excludes everything past them draws from them without the whole vocabulary sorted. A sort of 32000
# probabilities took ~2 ms on the CPU, several times a small model's decode step.
CANDIDATES = 1024


def _sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> torch.Tensor:
    device, vocab = logits.device, logits.shape[-1]
    temperatures = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    probs = torch.softmax(logits / temperatures, dim=-1)
    if not any(_filters(p, vocab) for p in params):
        return torch.stack([draw(probs[i], g) for i, g in enumerate(generators)])
    count = min(vocab, max(p.top_k if 0 < p.top_k < vocab else CANDIDATES for p in params))
    # each row's first `count` of the descending sort
    top_probs, top_order = probs.topk(count, dim=-1)
    within = [_decided_within(top_probs[i], p, vocab) for i, p in enumerate(params)]
    drawn = torch.empty(len(params), dtype=torch.int64, device=device)
    for decided in (True, False):
        rows = [i for i, w in enumerate(within) if w == decided]
        if not rows:
            continue
        index = torch.tensor(rows, device=device)
        if decided:
            sorted_probs, order = top_probs[index], top_order[index]
        else:  # the filters reach past the candidates: the whole vocabulary sorted
            sorted_probs, order = probs[index].sort(dim=-1, descending=True)
        kept = sorted_probs.masked_fill(
            _filter_mask(sorted_probs, [params[i] for i in rows], vocab), 0.0
        )
        for j, i in enumerate(rows):
            drawn[i] = order[j, draw(kept[j], generators[i])]
    return drawn


def _filters(p: SamplingParams, vocab: int) -> bool:
    """Whether top-k, top-p or min-p exclude any token of a row."""
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0


def _decided_within(top_probs: torch.Tensor, p: SamplingParams, vocab: int) -> bool:
    """Whether the filters exclude every token past a row's most likely ones ``top_probs`` (descending)."""
    count = top_probs.numel()
    if count == vocab or 0 < p.top_k <= count:
        return True
    if p.top_p < 1.0 and top_probs.sum().item() >= p.top_p:
        return True  # the tokens past them come after the top-p mass
    return p.min_p > 0.0 and top_probs[-1].item() < top_probs[0].item() * p.min_p


def draw(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index of ``weights`` (1-D, non-negative, not all zero) with probability proportional to its weight: the
    first whose cumulative weight passes a uniform draw of the generator (a zero weight is never chosen). What
    ``torch.multinomial(weights, 1)`` samples: over 32000 weights on the CPU 0.045 ms against its 0.66."""
    cdf = weights.double().cumsum(0)
    total = cdf[-1].item()
    if not (math.isfinite(total) and total > 0.0):  # as torch.multinomial refuses such weights
        raise ValueError(
            f"no token to sample: the probabilities sum to {total} (NaN or infinite logits?)"
        )
    uniform = torch.rand((), dtype=torch.float64, generator=generator, device=weights.device)
    index = torch.searchsorted(cdf, uniform * total, right=True)
    if index.item() == cdf.numel():
        # the draw rounded up to the total: the last token of any weight
        index = weights.nonzero()[-1, 0]
    return index


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws its next token from, for each of ``logits``' rows [N, V]: the
    temperature's softmax with the tokens top-k, top-p and min-p filter out at zero (not renormalised, as
    ``torch.multinomial`` takes it)."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mask = _filter_mask(sorted_probs, [params] * logits.shape[0], logits.shape[-1])
    return probs.scatter(1, order, sorted_probs.masked_fill(mask, 0.0))


def _filter_mask(
    sorted_probs: torch.Tensor, params: list[SamplingParams], vocab: int
) -> torch.Tensor:
    """True where a token is filtered out; the most likely token is always kept. ``sorted_probs``: each row's
    probabilities in descending order, the whole vocabulary or its first tokens."""
    device = sorted_probs.device
    top_k = torch.tensor(
        [p.top_k if p.top_k > 0 else vocab for p in params], device=device
    ).unsqueeze(1)
    top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
    min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
    ranks = torch.arange(sorted_probs.shape[-1], device=device).unsqueeze(0)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # float error must not trim the tail when top_p is 1
    beyond_top_p = (mass_before >= top_p) & (top_p < 1.0)
    mask = (ranks >= top_k) | beyond_top_p | (sorted_probs < sorted_probs[:, :1] * min_p)
    mask[:, 0] = False
    return mask


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


_MASK64 = 2**64 - 1


def step_seed(seed: int, position: int) -> int:
    """The seed of a request's draw at output ``position`` under batch invariance (splitmix64 of the two): a draw
    then depends on the request's seed and position alone, not on how many draws its generator made before (a
    retraction, a PD hand-over, a DP rank's restart)."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & (2**63 - 1)
