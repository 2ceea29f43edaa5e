"""Speculation in a tensor-parallel world (2 ranks, each with its shard of the MTP head): the greedy tokens of one
rank without speculation, the same drafts accepted, and seeded sampled tokens equal to one rank's."""

from __future__ import annotations

from sglang_lite import Engine
from tests.engine.conftest import random_prompts

GREEDY = {"max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True}
SAMPLED = {"max_new_tokens": 20, "temperature": 0.6, "top_k": 3, "seed": 4, "ignore_eos": True}
COMMON = dict(
    skip_tokenizer_init=True,
    cpu_threads_per_rank=1,
    max_total_tokens=1024,
    max_running_requests=4,
    chunked_prefill_size=8,
)


def generate(path: str, **extra) -> tuple[list, list, list]:
    prompts = random_prompts([3, 17, 40, 9], vocab=160, seed=1)
    with Engine(path, **COMMON, **extra) as engine:
        greedy = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        sampled = engine.generate(input_ids=prompts, sampling_params=SAMPLED)
    accepted = [r["meta_info"]["spec_accept_token_num"] for r in greedy]
    return [r["output_ids"] for r in greedy], [r["output_ids"] for r in sampled], accepted


def test_tp2_speculation_matches_one_rank(spec_checkpoints):
    path = spec_checkpoints[("moe", "repeat")]
    one = generate(path, speculative_algorithm="NEXTN")
    two = generate(path, speculative_algorithm="NEXTN", tp_size=2)
    assert two == one
    assert sum(one[2]) > 0
