"""Speculative sampling keeps the model's distribution (a chi-square test with a fixed seed on a small
vocabulary), seeded requests are reproducible with speculation, and the greedy rule."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from sglang_lite.sampling.draft_acceptance import verify_chain
from sglang_lite.sampling.params import SamplingParams
from tests.engine.conftest import random_prompts
from tests.speculative.conftest import run_scheduler, scheduler_args

TRIALS = 20000


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """softmax(logits / T) over the top_k most likely tokens, written out independently of the sampler."""
    keep = logits.topk(top_k).indices
    masked = torch.full_like(logits, float("-inf"))
    masked[keep] = logits[keep] / temperature
    return torch.softmax(masked, dim=-1)


@pytest.mark.parametrize("temperature,top_k", [(1.0, -1), (0.7, 4)])
def test_emitted_tokens_follow_the_target_distribution(temperature, top_k):
    """First emitted token ~ p(row 0); given that it was the first draft, the second ~ p(row 1); drafts chosen
    both likely and unlikely so that acceptance and rejection both happen often."""
    vocab = 6
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(7)) * 1.5
    drafts = [int(logits[0].argmax()), int(logits[1].argmin())]
    params = SamplingParams(temperature=temperature, top_k=top_k)
    generator = torch.Generator().manual_seed(1234)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(TRIALS):
        out = verify_chain(logits, drafts, params, generator)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
    k = vocab if top_k < 0 else top_k
    for counts, row in ((first, 0), (second, 1)):
        expected = reference_probs(logits[row], temperature, k) * counts.sum()
        support = expected > 0
        assert counts[~support].sum() == 0, "a token outside the filtered distribution was emitted"
        result = chisquare(counts[support].numpy(), expected[support].numpy())
        assert result.pvalue > 1e-3, (row, counts, expected)


def test_greedy_accepts_the_agreeing_prefix_plus_one():
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    assert verify_chain(logits, [1, 2], greedy, None) == [1, 2, 0]
    assert verify_chain(logits, [1, 0], greedy, None) == [1, 2]
    assert verify_chain(logits, [2, 2], greedy, None) == [1]


def test_seeded_sampled_requests_are_reproducible(spec_checkpoints):
    path = spec_checkpoints[("moe", "repeat")]
    prompts = random_prompts([5, 12, 30], vocab=160, seed=6)
    requests = [
        (
            p,
            {
                "temperature": 0.5,
                "top_k": 2,
                "seed": 11 + i,
                "max_new_tokens": 16,
                "ignore_eos": True,
            },
        )
        for i, p in enumerate(prompts)
    ]
    args = scheduler_args(path, speculative_algorithm="NEXTN", speculative_num_steps=2)
    first, _, scheduler = run_scheduler(args, requests)
    again, _, _ = run_scheduler(args, requests)
    assert first == again
    assert all(len(tokens) == 16 for tokens in first.values())
    assert scheduler.speculation.stats.accepted > 0
