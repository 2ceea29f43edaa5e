"""Parallel samples (``n`` > 1): one prefill, then n continuations forked from the prompt's KV and GDN state, each
with its own seed. Each sample equals the same request run alone with that seed."""

from __future__ import annotations

import pytest

from sglang_lite import Engine
from sglang_lite.runtime.factory import create_scheduler
from sglang_lite.server_args import ServerArgs
from tests.engine.conftest import random_prompts
from tests.engine.test_engine_parity import small_chunks


def run(scheduler, requests: dict[str, tuple[list[int], dict]]) -> dict[str, list[int]]:
    for rid, (prompt, params) in requests.items():
        scheduler.add_request(rid, prompt, params)
    results: dict[str, list[int]] = {}
    while scheduler.has_work:
        for out in scheduler.step():
            results.setdefault(out.rid, []).extend(out.new_token_ids)
        scheduler.check_invariants()
    return results


@pytest.mark.parametrize("cache", ["radix", "no-cache"])
def test_n_samples_prefill_once_and_equal_their_seeds_run_alone(checkpoints, cache):
    checkpoint = checkpoints["moe"]
    args = small_chunks(checkpoint.path, disable_radix_cache=cache == "no-cache")
    (prompt,) = random_prompts([21], seed=2)
    sampled = {"max_new_tokens": 10, "temperature": 1.0, "seed": 40, "ignore_eos": True}
    scheduler = create_scheduler(ServerArgs(**args))
    together = run(scheduler, {"p": (prompt, {**sampled, "n": 3})})
    assert scheduler.num_prefill_tokens == len(
        prompt
    )  # the forks read the prompt, never prefill it
    assert scheduler.get_loads().num_used_tokens == 0
    alone = create_scheduler(ServerArgs(**args))
    for rid, seed in [("p", 40), ("p.n1", 41), ("p.n2", 42)]:
        expected = run(alone, {rid: (prompt, {**sampled, "seed": seed})})[rid]
        assert together[rid] == expected, rid
    assert len({tuple(together[r]) for r in together}) > 1, "different seeds draw different samples"


def test_greedy_samples_match_transformers_and_forks_wait_when_memory_is_short(checkpoints):
    """Two requests with n = 3 in a pool of 4 rows: some forks find no row and prefill later, as any request."""
    checkpoint = checkpoints["dense"]
    prompts = random_prompts([9, 14], seed=4)
    greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True, "n": 3}
    scheduler = create_scheduler(
        ServerArgs(**small_chunks(checkpoint.path, max_running_requests=4))
    )
    results = run(scheduler, {"a": (prompts[0], greedy), "b": (prompts[1], greedy)})
    assert sorted(results) == ["a", "a.n1", "a.n2", "b", "b.n1", "b.n2"]
    for rid, tokens in results.items():
        assert tokens == checkpoint.greedy(prompts[0 if rid.startswith("a") else 1], 6), rid
    assert scheduler.num_prefill_tokens > len(prompts[0]) + len(
        prompts[1]
    )  # the waiting forks prefilled


def test_aborting_a_sample_before_its_fork_and_a_parent_that_ends_first(checkpoints):
    checkpoint = checkpoints["moe"]
    scheduler = create_scheduler(ServerArgs(**small_chunks(checkpoint.path)))
    (prompt,) = random_prompts([30], seed=6)
    scheduler.add_request("x", prompt, {"max_new_tokens": 4, "n": 3, "ignore_eos": True})
    with pytest.raises(ValueError, match="x.n1"):
        scheduler.add_request("x.n1", prompt, {"max_new_tokens": 4})
    assert scheduler.abort("x.n2")
    scheduler.add_request("y", prompt, {"max_new_tokens": 4, "n": 2})
    assert scheduler.abort("y")  # the parent goes before forking: its sample ends with it
    finished = {}
    while scheduler.has_work:
        for out in scheduler.step():
            if out.finished:
                finished[out.rid] = (
                    out.meta_info["finish_reason"]["type"],
                    out.meta_info["completion_tokens"],
                )
        scheduler.check_invariants()
    assert finished == {
        "x": ("length", 4),
        "x.n1": ("length", 4),
        "x.n2": ("abort", 0),
        "y": ("abort", 0),
        "y.n1": ("abort", 0),
    }


def test_engine_returns_n_results_per_prompt(checkpoints):
    checkpoint = checkpoints["moe"]
    prompts = random_prompts([5, 7], seed=8)
    params = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True, "n": 2}
    with Engine(checkpoint.path, skip_tokenizer_init=True) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=params)
        with pytest.raises(ValueError, match="n"):
            engine.generate(input_ids=prompts[0], sampling_params={**params, "n": 0})
    assert [r["output_ids"] for r in results] == [
        checkpoint.greedy(p, 3) for p in prompts for _ in range(2)
    ]
