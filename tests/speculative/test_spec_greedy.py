"""Speculative decoding with the MTP head inside continuous batching: greedy tokens are those without it, for
dense and MoE models, requests of different lengths and acceptance in one batch, pages of 1 and 16 tokens, the
prefix cache, retraction, and the length, stop-token and stop-string limits (nothing past them)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from sglang_lite import assets
from tests.engine.conftest import random_prompts
from tests.hf_checkpoints import greedy_tokens
from tests.speculative.conftest import GREEDY, run_scheduler, scheduler_args

LENGTHS = [3, 17, 40, 9, 25, 1]
NEXTN = dict(speculative_algorithm="NEXTN", speculative_num_steps=3)


def greedy_requests(seed: int = 1, new_tokens: int = 20) -> list[tuple[list[int], dict]]:
    prompts = random_prompts(LENGTHS, vocab=160, seed=seed)
    return [(p, {**GREEDY, "max_new_tokens": new_tokens - i}) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("kind", ["moe", "dense"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_tokens_are_unchanged(spec_checkpoints, kind, page_size):
    path = spec_checkpoints[(kind, "repeat")]
    requests = greedy_requests()
    plain, _, _ = run_scheduler(scheduler_args(path, page_size=page_size), requests)
    spec, metas, scheduler = run_scheduler(
        scheduler_args(path, page_size=page_size, **NEXTN), requests
    )
    assert spec == plain
    stats = scheduler.speculation.stats
    assert 0 < stats.accepted < stats.drafted, "both accepted and rejected drafts must occur"
    for i, (_, params) in enumerate(requests):
        meta = metas[i]
        assert meta["completion_tokens"] == params["max_new_tokens"]
        # the first token comes from the prefill, each verify step gives its accepted drafts plus one
        assert (
            meta["completion_tokens"] == 1 + meta["spec_verify_ct"] + meta["spec_accept_token_num"]
        )


def test_greedy_tokens_match_transformers(spec_checkpoints):
    """transformers ``generate`` of each prompt alone (it skips the checkpoint's ``mtp.*`` tensors)."""
    path = spec_checkpoints[("dense", "repeat")]
    requests = greedy_requests()
    spec, _, scheduler = run_scheduler(scheduler_args(path, **NEXTN), requests)
    assert scheduler.speculation.stats.accepted > 0
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for i, (prompt, params) in enumerate(requests):
        assert spec[i] == greedy_tokens(hf, prompt, params["max_new_tokens"]), i


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_random_head_stays_exact(spec_checkpoints, kind):
    path = spec_checkpoints[(kind, "random")]
    requests = greedy_requests(seed=2)
    plain, _, _ = run_scheduler(scheduler_args(path), requests)
    spec, _, _ = run_scheduler(
        scheduler_args(path, speculative_num_draft_tokens=3, **{"speculative_algorithm": "EAGLE"}),
        requests,
    )
    assert spec == plain


def test_prefix_cache_hits_and_late_arrivals(spec_checkpoints):
    """Requests sharing prefixes arrive after others have finished (cached) and while others decode."""
    path = spec_checkpoints[("moe", "repeat")]
    base = random_prompts([30], vocab=160, seed=3)[0]
    prompts = [base, base + [5, 6], base[:20] + [7], base + [5, 6, 9, 9]]
    params = {**GREEDY, "max_new_tokens": 12}

    def run(args):
        from sglang_lite.runtime.factory import create_scheduler

        scheduler = create_scheduler(args)
        outputs: dict[str, list[int]] = {}
        arrivals = {0: [0], 25: [1, 2], 27: [3]}
        step = 0
        while step < 30 or scheduler.has_work:
            for i in arrivals.get(step, []):
                scheduler.add_request(str(i), prompts[i], params)
            for out in scheduler.step():
                outputs.setdefault(out.rid, []).extend(out.new_token_ids)
            scheduler.check_invariants()
            step += 1
        return outputs, scheduler

    plain, _ = run(scheduler_args(path))
    spec, scheduler = run(scheduler_args(path, **NEXTN))
    assert spec == plain
    assert scheduler.prefill.prompt_tokens_cached > 0
    assert scheduler.get_loads().num_used_tokens == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_retraction_keeps_tokens(spec_checkpoints, page_size):
    """80 KV slots hold about two of these requests and admission reserves nothing: decode must retract."""
    path = spec_checkpoints[("moe", "repeat")]
    requests = greedy_requests(new_tokens=16)
    small = dict(max_total_tokens=80, page_size=page_size, schedule_conservativeness=0.0)
    plain, _, _ = run_scheduler(scheduler_args(path, **small), requests)
    spec, metas, scheduler = run_scheduler(scheduler_args(path, **small, **NEXTN), requests)
    assert spec == plain
    assert scheduler.decode.num_retractions > 0


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5, 8])
def test_length_limit_is_exact(spec_checkpoints, max_new_tokens):
    path = spec_checkpoints[("moe", "repeat")]
    requests = [
        (p, {**GREEDY, "max_new_tokens": max_new_tokens}) for p in random_prompts(LENGTHS, 160, 1)
    ]
    spec, metas, _ = run_scheduler(scheduler_args(path, **NEXTN), requests)
    plain, _, _ = run_scheduler(scheduler_args(path), requests)
    assert spec == plain
    assert all(len(tokens) == max_new_tokens for tokens in spec.values())
    assert all(
        m["finish_reason"] == {"type": "length", "length": max_new_tokens} for m in metas.values()
    )


def test_stop_token_inside_accepted_drafts(spec_checkpoints):
    """A stop token the drafts run past ends the request there, as without speculation."""
    path = spec_checkpoints[("moe", "repeat")]
    prompts = random_prompts(LENGTHS, 160, 1)
    plain, _, _ = run_scheduler(
        scheduler_args(path), [(p, {**GREEDY, "max_new_tokens": 20}) for p in prompts]
    )
    # each request's stop token: one it produces after a run of repeats (drafts get accepted up to it)
    requests = []
    for i, p in enumerate(prompts):
        stop = plain[i][-1]
        requests.append((p, {**GREEDY, "max_new_tokens": 20, "stop_token_ids": [stop]}))
    without, metas_plain, _ = run_scheduler(scheduler_args(path), requests)
    spec, metas, _ = run_scheduler(scheduler_args(path, **NEXTN), requests)
    assert spec == without
    for i in range(len(prompts)):
        assert metas[i]["finish_reason"] == metas_plain[i]["finish_reason"]
        assert metas[i]["finish_reason"]["type"] == "stop"


def test_stop_string_inside_accepted_drafts(spec_checkpoints):
    path = spec_checkpoints[("moe", "repeat")]
    tokenizer = assets.model_dir(None)
    prompts = random_prompts(LENGTHS, 160, 1)
    greedy = {**GREEDY, "max_new_tokens": 20}
    plain, _, scheduler = run_scheduler(
        scheduler_args(path, tokenizer_path=tokenizer, skip_tokenizer_init=False),
        [(p, greedy) for p in prompts],
    )
    decode = scheduler.tokenizer.decode
    requests = []
    for i, p in enumerate(prompts):
        text = decode(plain[i])
        stop = text[len(text) // 2 : len(text) // 2 + 2] or text
        requests.append((p, {**greedy, "stop": [stop]}))
    args = dict(tokenizer_path=tokenizer, skip_tokenizer_init=False)
    outputs = []
    for extra in ({}, NEXTN):
        scheduler_tokens, metas, _ = run_scheduler(scheduler_args(path, **args, **extra), requests)
        outputs.append((scheduler_tokens, [metas[i]["finish_reason"] for i in range(len(prompts))]))
    assert outputs[1] == outputs[0]
    assert any(reason["type"] == "stop" for reason in outputs[0][1])
