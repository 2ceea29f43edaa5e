"""Speculation beside the rest of a request's life: parallel samples (``n > 1``), aborts mid-decode,
log-probabilities (of accepted drafts too), penalties, logit biases and min-tokens bans, all in one batch with
drafted requests."""

from __future__ import annotations

import torch

from sglang_lite.runtime.factory import create_scheduler
from sglang_lite.sampling.logprobs import LogprobParams
from tests.engine.conftest import random_prompts
from tests.speculative.conftest import GREEDY, scheduler_args

NEXTN = dict(speculative_algorithm="NEXTN", speculative_num_steps=3)


def run(args, requests: dict, abort_at: dict[int, str] | None = None) -> tuple[dict, dict, object]:
    """Runs ``rid -> (prompt, params, logprob)`` to the end; aborts ``abort_at[step]`` before that step.
    Returns each rid's tokens, its last meta_info and the scheduler."""
    scheduler = create_scheduler(args)
    for rid, (prompt, params, logprob) in requests.items():
        scheduler.add_request(rid, prompt, params, logprob=logprob)
    tokens: dict[str, list[int]] = {}
    metas: dict[str, dict] = {}
    step = 0
    while scheduler.has_work:
        if abort_at and step in abort_at:
            assert scheduler.abort(abort_at[step])
        for out in scheduler.step():
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
            metas.setdefault(out.rid, {}).update(out.meta_info)
            for key, value in out.meta_info.items():
                if key.endswith("logprobs"):
                    metas[out.rid].setdefault("all_" + key, []).extend(value)
        scheduler.check_invariants()
        step += 1
    assert scheduler.get_loads().num_used_tokens == 0
    return tokens, metas, scheduler


def mixed_requests() -> dict:
    prompts = random_prompts([6, 20, 33, 11], vocab=160, seed=8)
    logprob = LogprobParams.from_dict({"return_logprob": True, "top_logprobs_num": 2})
    return {
        "greedy": (prompts[0], {**GREEDY, "max_new_tokens": 18}, None),
        "logprob": (prompts[0], {**GREEDY, "max_new_tokens": 18}, logprob),
        "penalised": (
            prompts[2],
            {**GREEDY, "max_new_tokens": 12, "frequency_penalty": 0.5},
            None,
        ),
        "parallel": (
            prompts[3],
            {"temperature": 0.7, "top_k": 3, "seed": 5, "n": 3, "max_new_tokens": 10},
            None,
        ),
        "greedy_pair": (prompts[0], {**GREEDY, "n": 2, "max_new_tokens": 18}, None),
    }


def test_mixed_batch_matches_speculation_off(spec_checkpoints):
    path = spec_checkpoints[("moe", "repeat")]
    requests = mixed_requests()
    plain, plain_meta, _ = run(scheduler_args(path), requests)
    spec, spec_meta, scheduler = run(scheduler_args(path, **NEXTN), requests)
    greedy = [rid for rid in plain if not rid.startswith("parallel")]
    assert {rid: spec[rid] for rid in greedy} == {rid: plain[rid] for rid in greedy}
    for rid in ("parallel", "parallel.n1", "parallel.n2"):
        assert len(spec[rid]) == 10, rid
    # the log-probabilities of the request that asked for them are those without speculation
    got = spec_meta["logprob"]["all_output_token_logprobs"]
    expected = plain_meta["logprob"]["all_output_token_logprobs"]
    top = spec_meta["logprob"]["all_output_top_logprobs"]
    top_expected = plain_meta["logprob"]["all_output_top_logprobs"]
    assert len(got) == len(expected) == len(top) == 18
    assert [e[1] for e in got] == [e[1] for e in expected]
    assert [[e[1] for e in row] for row in top] == [[e[1] for e in row] for row in top_expected]
    values = torch.tensor([e[0] for e in got] + [e[0] for row in top for e in row])
    reference = torch.tensor([e[0] for e in expected] + [e[0] for row in top_expected for e in row])
    assert torch.allclose(values, reference, atol=1e-5)
    assert spec_meta["greedy"]["spec_accept_token_num"] > 0
    assert spec_meta["logprob"]["spec_accept_token_num"] > 0, "log-probabilities of accepted drafts"
    assert spec_meta["penalised"]["spec_draft_token_num"] > 0, "penalised requests are drafted for"
    assert spec_meta["greedy_pair.n1"]["spec_accept_token_num"] > 0, (
        "a fork drafts from its second step"
    )


def test_abort_mid_decode_frees_everything(spec_checkpoints):
    path = spec_checkpoints[("moe", "repeat")]
    requests = {
        rid: (prompt, {**GREEDY, "max_new_tokens": 30}, None)
        for rid, prompt in zip("abc", random_prompts([7, 19, 4], vocab=160, seed=9))
    }
    plain, _, _ = run(scheduler_args(path), requests)
    spec, metas, _ = run(scheduler_args(path, **NEXTN), requests, abort_at={6: "b"})
    assert metas["b"]["finish_reason"]["type"] == "abort"
    assert spec["b"] == plain["b"][: len(spec["b"])] and len(spec["b"]) < 30
    assert (spec["a"], spec["c"]) == (plain["a"], plain["c"])


def test_penalties_biases_and_min_tokens_are_drafted_for_and_kept(spec_checkpoints):
    """A request's penalties (the drafts before a row counted), logit biases and min-tokens ban on stop tokens act
    on each verify row as the sampler's."""
    path = spec_checkpoints[("moe", "repeat")]
    prompts = random_prompts([6, 20], vocab=160, seed=8)
    free = {rid: (p, {**GREEDY, "max_new_tokens": 18}, None) for rid, p in zip("ab", prompts)}
    plain, _, _ = run(scheduler_args(path), free)
    repeated = plain["a"][-1]  # the token the run ends repeating
    # biased away from b's later tokens: the decode steps that verify drafts must see the biases
    bias = {str(t): -100.0 for t in plain["b"][2:6]} | {"7": 2.0}
    sampled = {"temperature": 0.5, "top_k": 2, "seed": 3, "max_new_tokens": 18}
    requests = {
        # the repeated token is the stop token, banned for the first 16 tokens
        "min_tokens": (
            prompts[0],
            {**GREEDY, "max_new_tokens": 18, "min_new_tokens": 16, "stop_token_ids": [repeated]},
            None,
        ),
        "bias": (prompts[1], {**GREEDY, "max_new_tokens": 18, "logit_bias": bias}, None),
        # penalised out of the repetition the unpenalised run ends in (drafts of it are rejected)
        "penalties": (
            prompts[0],
            {**GREEDY, "max_new_tokens": 24, "frequency_penalty": 0.3, "repetition_penalty": 1.2},
            None,
        ),
        # a light one: drafts of the repetition are accepted until the counted drafts tip a row
        "light": (prompts[0], {**GREEDY, "max_new_tokens": 30, "frequency_penalty": 0.02}, None),
        "presence": (prompts[0], {**GREEDY, "max_new_tokens": 24, "presence_penalty": 0.05}, None),
        "bias_sampled": (prompts[1], {**sampled, "logit_bias": bias}, None),
    }
    expected, expected_meta, _ = run(scheduler_args(path), requests)
    got, metas, _ = run(scheduler_args(path, **NEXTN), requests)
    for rid in ("min_tokens", "bias", "penalties", "light", "presence"):
        assert got[rid] == expected[rid], rid
    assert metas["light"]["spec_accept_token_num"] > 0
    assert got["bias"] != plain["b"], "the biases must matter"
    assert len(got["bias_sampled"]) == 18
    assert not set(got["bias_sampled"]) & {int(t) for t, v in bias.items() if v < 0}
    assert metas["min_tokens"]["finish_reason"] == expected_meta["min_tokens"]["finish_reason"]
    assert metas["min_tokens"]["spec_draft_token_num"] > 0
    assert metas["bias"]["spec_draft_token_num"] > 0


def test_a_failing_verify_forward_fails_its_batch_and_frees_its_slots(
    spec_checkpoints, monkeypatch
):
    path = spec_checkpoints[("moe", "repeat")]
    prompts = random_prompts([6, 20, 9], vocab=160, seed=10)
    params = {**GREEDY, "max_new_tokens": 12}
    expected, _, _ = run(scheduler_args(path), {"after": (prompts[2], params, None)})
    scheduler = create_scheduler(scheduler_args(path, page_size=4, **NEXTN))
    for rid, prompt in zip("ab", prompts):
        scheduler.add_request(rid, prompt, params)

    def both_drafted() -> bool:  # both prefilled, holding their first drafts
        running = scheduler.queues.running
        return len(running) == 2 and all(r.drafts is not None for r in running)

    for _ in range(20):
        if both_drafted():
            break
        scheduler.step()
    assert both_drafted()
    real = scheduler.runner.forward_verify

    def verify_failing_once(batch, counts):
        if not failed:
            failed.append(batch)
            raise RuntimeError("a kernel raised")
        return real(batch, counts)

    failed: list = []
    monkeypatch.setattr(scheduler.runner, "forward_verify", verify_failing_once)
    outputs = scheduler.step()
    scheduler.check_invariants()
    assert failed and {o.rid for o in outputs if o.finished} == {"a", "b"}
    assert all("a kernel raised" in o.meta_info["finish_reason"]["message"] for o in outputs)
    assert scheduler.get_loads().num_used_tokens == 0
    scheduler.add_request("after", prompts[2], params)
    tokens = []
    while scheduler.has_work:
        tokens += [t for o in scheduler.step() for t in o.new_token_ids]
        scheduler.check_invariants()
    assert tokens == expected["after"]
