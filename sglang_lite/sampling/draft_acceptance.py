"""Verifying a chain of drafted tokens against the target model's logits, keeping the target's distribution.

The MTP head drafts greedily, so each draft ``d`` is certain under the draft distribution (q = one-hot at d).
Standard speculative sampling then reads: accept ``d`` with probability min(1, p(d) / q(d)) = p(d); on a rejection
draw from norm(max(p - q, 0)), which is p without d; when every draft is accepted draw the bonus token from the
last position's p. Each emitted token is then distributed as the target's (Leviathan et al. 2023, Chen et al.
2023). Greedy requests accept while the draft is the argmax, then take the argmax. Draws use the request's own
generator, so a seeded request is reproducible.
"""

from __future__ import annotations

import torch

from sglang_lite.sampling.params import SamplingParams
from sglang_lite.sampling.sampler import argmax_rows, filtered_probs


def verify_chain(
    logits: torch.Tensor,
    drafts: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
) -> list[int]:
    """The tokens to emit: the accepted prefix of ``drafts`` and one more (the corrected or bonus token).
    ``logits`` [len(drafts) + 1, V]: row j is the target's next-token logits after draft j (row 0: after the
    last emitted token)."""
    assert logits.shape[0] == len(drafts) + 1, "one row per draft plus the bonus row"
    if params.is_greedy:
        return _verify_greedy(argmax_rows(logits).tolist(), drafts)
    probs = filtered_probs(logits, params)
    out: list[int] = []
    for row, draft in enumerate(drafts):
        accept_prob = probs[row, draft] / probs[row].sum()
        if _uniform(generator, logits.device) < accept_prob:
            out.append(draft)
            continue
        residual = probs[row].clone()
        residual[draft] = 0.0
        return out + [_draw(residual, generator)]
    return out + [_draw(probs[-1], generator)]


def _verify_greedy(best: list[int], drafts: list[int]) -> list[int]:
    out = []
    for row, draft in enumerate(drafts):
        if best[row] != draft:
            break
        out.append(draft)
    return out + [best[len(out)]]


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    where = generator.device if generator is not None else device
    return float(torch.rand((), generator=generator, device=where))


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(weights, 1, generator=generator))
