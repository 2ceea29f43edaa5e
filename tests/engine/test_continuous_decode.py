"""``--num-continuous-decode-steps``: decode steps run back to back while nothing waits give every request the same
tokens, text, log-probabilities and finish as steps scheduled one at a time, free what the steps not run held, and
on the CPU run greedy batches in one C++ call (``Runner.decode_greedy``)."""

from __future__ import annotations

import os
import select

import pytest

from sglang_lite.protocol.outputs import join_outputs
from sglang_lite.runtime.factory import create_scheduler
from sglang_lite.server_args import ServerArgs
from sglang_lite.utils import schedule_flags
from tests.engine.conftest import random_prompts

ARGS = dict(max_total_tokens=2048, max_running_requests=4, page_size=4)


@pytest.fixture(scope="module")
def schedulers():
    """The built-in tiny model (with its tokenizer) one step at a time and up to 8 steps a run; and the reference,
    one step at a time through the logits and the sampler always, prefills too (a step of one request otherwise
    takes the one call, and a greedy prefill's first tokens come without the logits)."""
    out = {
        steps: create_scheduler(ServerArgs(**ARGS, num_continuous_decode_steps=steps))
        for steps in (1, 8)
    }
    out["reference"] = create_scheduler(ServerArgs(**ARGS, num_continuous_decode_steps=1))
    out["reference"].runner.decode_greedy = lambda *args: None
    out["reference"].runner.extend_greedy = lambda *args: None
    return out


@pytest.fixture(autouse=True)
def no_time_budget(monkeypatch):
    """Runs as long as the flag allows, however slow the machine (the budget only cuts runs shorter)."""
    monkeypatch.setattr(schedule_flags, "RUN_BUDGET_S", 1e9)


def serve(scheduler, requests: dict[str, tuple[list[int], dict]]) -> tuple[dict, int]:
    """Each request's outputs joined, and the steps it took; the invariants checked after every step."""
    for rid, (prompt, params) in requests.items():
        scheduler.add_request(rid, prompt, params, logprob=params.pop("logprob", None))
    outputs: dict[str, list] = {}
    steps = 0
    while scheduler.has_work and steps < 2000:
        for out in scheduler.step():
            outputs.setdefault(out.rid, []).append(out)
        scheduler.check_invariants()
        steps += 1
    assert not scheduler.has_work
    assert scheduler.memory.pools.req_to_token.allocator.num_used == 0
    return {rid: join_outputs(outs) for rid, outs in outputs.items()}, steps


def same(got, want) -> None:
    for rid, out in want.items():
        assert got[rid].new_token_ids == out.new_token_ids, rid
        assert got[rid].new_text == out.new_text, rid
        assert got[rid].meta_info["finish_reason"] == out.meta_info["finish_reason"], rid
        for key in ("output_token_logprobs", "output_top_logprobs"):
            assert got[rid].meta_info.get(key) == out.meta_info.get(key), (rid, key)


def requests(vocab: int, stop_token: int | None = None, stop_text: str | None = None) -> dict:
    prompts = random_prompts([9, 14, 5, 20], vocab=vocab, seed=11)
    greedy = {"temperature": 0.0, "max_new_tokens": 23, "ignore_eos": True}
    out = {
        "greedy": (prompts[0], dict(greedy)),
        "short": (prompts[1], dict(greedy, max_new_tokens=3)),
        "odd": (prompts[2], dict(greedy, max_new_tokens=17)),
        "long": (prompts[3], dict(greedy, max_new_tokens=30)),
    }
    if stop_token is not None:
        out["short"] = (prompts[1], dict(greedy, stop_token_ids=[stop_token], ignore_eos=False))
    if stop_text is not None:
        out["odd"] = (prompts[2], dict(greedy, stop=[stop_text]))
    return out


def test_greedy_runs_equal_single_steps_in_one_call_each(schedulers, monkeypatch):
    single, runs = schedulers["reference"], schedulers[8]
    vocab = single.config.vocab_size
    want, single_steps = serve(single, requests(vocab))
    calls = []
    real = runs.runner.decode_greedy
    monkeypatch.setattr(runs.runner, "decode_greedy", lambda *a: calls.append(1) or real(*a))
    got, run_steps = serve(runs, requests(vocab))
    same(got, want)
    assert calls and run_steps < single_steps / 2
    # a stop token produced mid-run ends its request there, and the run with it; the others go on
    stop = want["short"].new_token_ids[1]
    want, _ = serve(single, requests(vocab, stop_token=stop))
    got, _ = serve(runs, requests(vocab, stop_token=stop))
    same(got, want)
    assert got["short"].meta_info["finish_reason"] == {"type": "stop", "matched": stop}


def test_one_request_one_step_at_a_time_takes_the_one_call(schedulers, monkeypatch):
    """A batch of one request takes the one call even at one step a run (its token through the LM head's greedy
    screen): the reference's tokens, a call a step; a batch of several takes the logits."""
    reference, single = schedulers["reference"], schedulers[1]
    vocab = single.config.vocab_size
    one = {"greedy": requests(vocab)["greedy"]}
    want, _ = serve(reference, {rid: (p, dict(params)) for rid, (p, params) in one.items()})
    calls = []
    real = single.runner.decode_greedy
    monkeypatch.setattr(single.runner, "decode_greedy", lambda *a: calls.append(1) or real(*a))
    got, _ = serve(single, {rid: (p, dict(params)) for rid, (p, params) in one.items()})
    same(got, want)
    # every decode step (the first token is the prefill's)
    assert len(calls) == len(want["greedy"].new_token_ids) - 1
    calls.clear()
    two = {rid: requests(vocab)[rid] for rid in ("short", "odd")}  # 3 and 17 new tokens
    want, _ = serve(reference, {rid: (p, dict(params)) for rid, (p, params) in two.items()})
    got, _ = serve(single, {rid: (p, dict(params)) for rid, (p, params) in two.items()})
    same(got, want)
    assert len(calls) == 17 - 3  # the steps "odd" ran alone


def test_greedy_prefills_take_their_first_tokens_without_the_logits(schedulers, monkeypatch):
    """A prefill whose requests are all plain greedy takes their first tokens through the LM head's greedy screen
    (``Runner.extend_greedy``): the reference's outputs; a sampled request's prefill reads the logits."""
    reference, single = schedulers["reference"], schedulers[1]
    cases = requests(single.config.vocab_size)
    want, _ = serve(reference, {rid: (p, dict(params)) for rid, (p, params) in cases.items()})
    found = []
    real = single.runner.extend_greedy
    monkeypatch.setattr(
        single.runner, "extend_greedy", lambda *a: found.append(real(*a)) or found[-1]
    )
    got, _ = serve(single, {rid: (p, dict(params)) for rid, (p, params) in cases.items()})
    same(got, want)
    assert found and all(tokens is not None for tokens in found)
    found.clear()
    serve(
        single,
        {"sampled": (cases["greedy"][0], {"temperature": 0.9, "seed": 5, "max_new_tokens": 4})},
    )
    assert not found


def test_stop_strings_sampling_logprobs_and_penalties_run_step_by_step_alike(schedulers):
    single, runs = schedulers["reference"], schedulers[8]
    vocab = single.config.vocab_size
    text = serve(single, requests(vocab))[0]["odd"].new_text
    stop_text = text[len(text) // 2 : len(text) // 2 + 3]
    cases = requests(vocab, stop_text=stop_text)
    cases["greedy"] = (cases["greedy"][0], {"temperature": 0.9, "seed": 5, "max_new_tokens": 21})
    cases["short"][1]["logprob"] = {"return_logprob": True, "top_logprobs_num": 2}
    cases["long"][1].update(frequency_penalty=0.7, min_new_tokens=4)
    want, _ = serve(single, {rid: (p, dict(params)) for rid, (p, params) in cases.items()})
    got, _ = serve(runs, {rid: (p, dict(params)) for rid, (p, params) in cases.items()})
    same(got, want)
    assert want["odd"].meta_info["finish_reason"]["type"] == "stop"


def test_a_detokeniser_failing_mid_run_fails_its_request_alone(schedulers):
    """Its later steps' KV is freed (the invariants hold after every step); the others take every step."""
    single, runs = schedulers["reference"], schedulers[8]
    cases = requests(single.config.vocab_size)
    want, _ = serve(single, {rid: (p, dict(params)) for rid, (p, params) in cases.items()})
    for rid, (prompt, params) in cases.items():
        runs.add_request(rid, prompt, dict(params))
    outputs: dict[str, list] = {}
    for out in runs.step():  # the prefill
        outputs.setdefault(out.rid, []).append(out)
    bad = next(r for r in runs.queues.running if r.rid == "long")
    pushed = []

    def broken_push(ids):
        pushed.append(ids)
        if len(pushed) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return ""

    bad.detokenizer.push = broken_push
    while runs.has_work:
        for out in runs.step():
            outputs.setdefault(out.rid, []).append(out)
        runs.check_invariants()
    got = {rid: join_outputs(outs) for rid, outs in outputs.items()}
    for rid in ("greedy", "short", "odd"):
        assert got[rid].new_token_ids == want[rid].new_token_ids
    assert got["long"].meta_info["finish_reason"]["status_code"] == 500


@pytest.mark.parametrize(
    "overrides, steps",
    [
        ({}, schedule_flags.CPU_DECODE_STEPS),
        ({"num_continuous_decode_steps": 3}, 3),
        ({"device": "cuda"}, 1),
        ({"tp_size": 2}, 1),
        ({"disaggregation_mode": "decode"}, 1),
        ({"speculative_algorithm": "NGRAM"}, 1),
    ],
)
def test_where_steps_run_back_to_back(overrides, steps):
    assert schedule_flags.decode_steps(ServerArgs(**overrides)) == steps


def test_a_bad_step_count_is_refused():
    with pytest.raises(ValueError, match="num_continuous_decode_steps"):
        ServerArgs(num_continuous_decode_steps=0)


class PipeArrivals:
    """``Arrivals`` (scheduler/decode.py) over a pipe: a command waits while the pipe holds a byte."""

    def __init__(self) -> None:
        self.fd, self.write_end = os.pipe()

    def waiting(self) -> bool:
        return self.arrived()

    def arrived(self) -> bool:
        return bool(select.select([self.fd], [], [], 0)[0])

    def close(self) -> None:
        os.close(self.fd)
        os.close(self.write_end)


def test_runs_watching_arrivals_keep_the_budget_only_while_a_request_streams(
    schedulers, monkeypatch
):
    """Where the rank watches for arriving commands, a run without a streaming request goes past the time budget
    (up to the flag's steps), one with a streaming request keeps to it, and every run is one step while a command
    waits; each gives the reference's tokens."""
    reference = schedulers["reference"]
    runs = create_scheduler(ServerArgs(**ARGS, num_continuous_decode_steps=8))
    arrivals = PipeArrivals()
    runs.watch_arrivals(arrivals)
    monkeypatch.setattr(
        schedule_flags, "RUN_BUDGET_S", 1e-9
    )  # a budget of no steps: one a run where it applies
    steps = []
    real = runs.runner.decode_greedy

    def counted(*args):
        tokens = real(*args)
        steps.append(len(tokens))
        return tokens

    monkeypatch.setattr(runs.runner, "decode_greedy", counted)
    try:
        cases = {"long": requests(runs.config.vocab_size)["long"]}  # 30 new tokens
        want, _ = serve(reference, {rid: (p, dict(params)) for rid, (p, params) in cases.items()})
        for stream, waiting, longest in ((False, False, 8), (True, False, 1), (False, True, 1)):
            if waiting:
                os.write(arrivals.write_end, b"x")
            steps.clear()
            for rid, (prompt, params) in cases.items():
                runs.add_request(rid, prompt, dict(params), stream=stream)
            outputs = {}
            while runs.has_work:
                for out in runs.step():
                    outputs.setdefault(out.rid, []).append(out)
            same({rid: join_outputs(outs) for rid, outs in outputs.items()}, want)
            assert max(steps) == longest, (stream, waiting, steps)
    finally:
        arrivals.close()
