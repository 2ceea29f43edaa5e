"""Scheduler policies on request dataclasses, server arguments, and the scheduler's bookkeeping on the tiny model."""

from __future__ import annotations

import argparse
import dataclasses
import time

import pytest

from sglang_lite.protocol.outputs import join_outputs
from sglang_lite.runtime.factory import create_scheduler
from sglang_lite.sampling import SamplingParams
from sglang_lite.scheduler.load_report import ThroughputMeter
from sglang_lite.scheduler.policy import NewTokenRatio, PrefillBudget, order_waiting, plan_prefill
from sglang_lite.scheduler.request import Req, ReqStatus
from sglang_lite.server_args import ServerArgs
from tests.engine.conftest import random_prompts


def req(rid: str, prompt_len: int, max_new: int = 10, arrival: float = 0.0) -> Req:
    prompt = list(range(1, prompt_len + 1))
    return Req(rid, prompt, SamplingParams(max_new_tokens=max_new), max_new, arrival_time=arrival)


def budget(**overrides) -> PrefillBudget:
    base = dict(
        kv_free=1000,
        admit_free=1000,
        batch_tokens=64,
        chunk_size=32,
        free_rows=8,
        new_token_ratio=0.5,
    )
    return PrefillBudget(**{**base, **overrides})


def test_order_waiting_fcfs_and_sjf():
    reqs = [req("a", 30, arrival=1.0), req("b", 5, arrival=2.0), req("c", 10, arrival=0.5)]
    assert [r.rid for r in order_waiting(reqs, "fcfs")] == ["c", "a", "b"]
    assert [r.rid for r in order_waiting(reqs, "sjf")] == ["b", "c", "a"]


def test_prefill_plan_chunks_a_long_prompt_and_stops_after_it():
    plan = plan_prefill(None, [req("a", 20), req("b", 50), req("c", 3)], budget())
    assert [(r.rid, n) for r, n in plan] == [("a", 20), ("b", 32)]  # b is chunked at 32; c waits


def test_prefill_plan_respects_the_batch_budget_and_rows():
    plan = plan_prefill(None, [req("a", 30), req("b", 30), req("c", 30)], budget(batch_tokens=40))
    assert [(r.rid, n) for r, n in plan] == [("a", 30), ("b", 10)]
    plan = plan_prefill(None, [req("a", 3), req("b", 3), req("c", 3)], budget(free_rows=2))
    assert [r.rid for r, _ in plan] == ["a", "b"]


def test_prefill_plan_reserves_decode_tokens():
    # each costs 10 prompt + ceil(0.5 * 10) reserved = 15
    plan = plan_prefill(None, [req("a", 10), req("b", 10), req("c", 10)], budget(admit_free=44))
    assert [r.rid for r, _ in plan] == ["a", "b"]


def test_chunked_request_continues_first():
    chunked = req("a", 100)
    chunked.num_computed = 32
    assert [(r.rid, n) for r, n in plan_prefill(chunked, [req("b", 5)], budget())] == [
        ("a", 32)
    ]  # still partial
    assert [(r.rid, n) for r, n in plan_prefill(chunked, [req("b", 5)], budget(kv_free=7))] == [
        ("a", 7)
    ]
    chunked.num_computed = 80
    assert [(r.rid, n) for r, n in plan_prefill(chunked, [req("b", 5)], budget())] == [
        ("a", 20),
        ("b", 5),
    ]


def test_new_token_ratio_decays_and_jumps_after_retraction():
    ratio = NewTokenRatio.from_conservativeness(1.0)
    start = ratio.value
    for _ in range(10_000):
        ratio.on_decode_step()
    assert ratio.value == pytest.approx(ratio.minimum) and ratio.minimum < start
    ratio.on_retraction()
    assert ratio.value > ratio.minimum
    assert NewTokenRatio.from_conservativeness(0.0).value == 0.0


def test_request_invariants_catch_bad_states():
    r = req("a", 4)
    r.check()
    r.status = ReqStatus.DECODING
    with pytest.raises(AssertionError):
        r.check()


def test_server_args_cli_defaults_come_from_the_dataclass():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert ServerArgs.from_cli_args(parser.parse_args([])) == ServerArgs()
    args = ServerArgs.from_cli_args(
        parser.parse_args(
            [
                "--max-total-tokens",
                "512",
                "--chunked-prefill-size",
                "64",
                "--disable-shared-experts-fusion",
                "--schedule-policy",
                "sjf",
            ]
        )
    )
    assert (
        args.max_total_tokens,
        args.chunked_prefill_size,
        args.disable_shared_experts_fusion,
    ) == (512, 64, True)
    assert dataclasses.replace(args, dp_size=2).dp_size == 2


@pytest.mark.parametrize(
    "bad", [{"schedule_policy": "lifo"}, {"mem_fraction_static": 0.0}, {"max_running_requests": 0}]
)
def test_server_args_reject_bad_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        ServerArgs(**bad)


# ---- the scheduler on the built-in tiny model ----------------------------------------------------------------------
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def scheduler():
    return create_scheduler(
        ServerArgs(
            load_format="dummy",
            max_total_tokens=512,
            max_running_requests=4,
            chunked_prefill_size=8,
            max_prefill_tokens=16,
            context_length=128,
        )
    )


def drain(scheduler, outputs=None, timeout_s: float = 120.0) -> dict[str, list]:
    """Steps until the scheduler has nothing left (a grammar compiling on its thread is waited for, however slow
    the machine), checking the invariants after every step."""
    outputs = {} if outputs is None else outputs
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not scheduler.has_work:
            return outputs
        for out in scheduler.step():
            outputs.setdefault(out.rid, []).append(out)
        scheduler.check_invariants()
        if scheduler.only_waiting_on_transfers:  # nothing to run until a grammar compiles
            time.sleep(0.002)
    raise AssertionError("the scheduler did not finish")


def assert_empty(scheduler) -> None:
    loads = scheduler.get_loads()
    assert (loads.num_used_tokens, loads.num_running_reqs, loads.num_waiting_reqs) == (0, 0, 0)
    assert (
        scheduler.pools.states.allocator.num_used
        == scheduler.pools.req_to_token.allocator.num_used
        == 0
    )


def test_abort_at_every_stage_frees_everything(scheduler):
    prompts = random_prompts([30, 5, 6, 7, 8, 9], vocab=4000, seed=3)
    for i, p in enumerate(prompts):
        scheduler.add_request(f"r{i}", p, GREEDY)
    scheduler.step()  # r0's first chunk: r0 is part-way through its prefill
    assert scheduler.queues.chunked is not None and scheduler.queues.chunked.rid == "r0"
    outputs = {}
    for out in scheduler.step():
        outputs.setdefault(out.rid, []).append(out)
    assert scheduler.abort("r0") and scheduler.abort(
        "r5"
    )  # chunked, and still waiting (4 rows: r4/r5 queue)
    while not scheduler.queues.running:
        drain_step(scheduler, outputs)
    decoding = scheduler.queues.running[0].rid
    assert scheduler.abort(decoding)
    assert not scheduler.abort("no-such-request")
    drain(scheduler, outputs)
    for rid in ("r0", "r5", decoding):
        assert (
            outputs[rid][-1].finished
            and outputs[rid][-1].meta_info["finish_reason"]["type"] == "abort"
        )
    others = [f"r{i}" for i in range(1, 5) if f"r{i}" != decoding]
    assert all(outputs[rid][-1].meta_info["finish_reason"]["type"] == "length" for rid in others)
    assert_empty(scheduler)


def drain_step(scheduler, outputs) -> None:
    for out in scheduler.step():
        outputs.setdefault(out.rid, []).append(out)
    scheduler.check_invariants()


def test_bad_request_raises_and_leaves_others_running(scheduler):
    prompt = random_prompts([10], vocab=4000, seed=4)[0]
    scheduler.add_request("good", prompt, GREEDY)
    reference = [t for out in drain(scheduler)["good"] for t in out.new_token_ids]
    scheduler.add_request("good", prompt, GREEDY)
    outputs: dict[str, list] = {}
    for _ in range(3):  # its prefill (chunked, or a cache hit): then it decodes
        if scheduler.queues.running:
            break
        drain_step(scheduler, outputs)
    assert scheduler.queues.running and scheduler.queues.running[0].rid == "good"
    for params, field in [({"temperature": -1.0}, "temperature"), ({"top_k": 0}, "top_k")]:
        with pytest.raises(ValueError, match=field):
            scheduler.add_request("bad", prompt, params)
    with pytest.raises(ValueError, match="context length"):
        scheduler.add_request("bad", list(range(128)), GREEDY)
    with pytest.raises(ValueError, match="rid 'good'"):
        scheduler.add_request(
            "good", prompt, GREEDY
        )  # in use: the running request is not disturbed
    drain(scheduler, outputs)
    assert [
        t for out in outputs["good"] for t in out.new_token_ids
    ] == reference and "bad" not in outputs
    assert_empty(scheduler)


def test_stop_token_min_new_tokens_and_zero_max_new(scheduler):
    prompt = random_prompts([6], vocab=4000, seed=5)[0]
    scheduler.add_request("free", prompt, {**GREEDY, "max_new_tokens": 10})
    free = [t for out in drain(scheduler)["free"] for t in out.new_token_ids]
    stop_at = free[4]
    first = free.index(stop_at)
    scheduler.add_request("stop", prompt, {**GREEDY, "stop_token_ids": [stop_at]})
    scheduler.add_request("zero", prompt, {**GREEDY, "max_new_tokens": 0})
    outputs = drain(scheduler)
    stop_ids = [t for out in outputs["stop"] for t in out.new_token_ids]
    assert stop_ids == free[: first + 1]
    assert outputs["stop"][-1].meta_info["finish_reason"] == {"type": "stop", "matched": stop_at}
    assert (
        outputs["zero"][-1].new_token_ids == []
        and outputs["zero"][-1].meta_info["finish_reason"]["length"] == 0
    )
    scheduler.add_request(
        "min", prompt, {**GREEDY, "stop_token_ids": [free[0]], "min_new_tokens": 3}
    )
    min_ids = [t for out in drain(scheduler)["min"] for t in out.new_token_ids]
    assert len(min_ids) >= 3 and free[0] not in min_ids[:3]
    assert_empty(scheduler)


def test_a_request_that_does_not_stream_sends_one_output(scheduler):
    """stream=False (the Engine's blocking generate): one output, when it finishes, with every token, the same
    tokens and log-probabilities as the streamed request's outputs joined (up to rounding: the two are different
    rows of each batch)."""
    prompt = random_prompts([7], vocab=4000, seed=11)[0]
    logprob = {"return_logprob": True, "top_logprobs_num": 2}
    scheduler.add_request("streamed", prompt, {**GREEDY, "max_new_tokens": 6}, logprob=logprob)
    scheduler.add_request(
        "whole", prompt, {**GREEDY, "max_new_tokens": 6}, logprob=logprob, stream=False
    )
    outputs = drain(scheduler)
    assert (
        len(outputs["streamed"]) == 6
        and len(outputs["whole"]) == 1
        and outputs["whole"][0].finished
    )
    streamed, whole = join_outputs(outputs["streamed"]), outputs["whole"][0]
    assert whole.new_token_ids == streamed.new_token_ids
    got, want = (
        whole.meta_info["output_token_logprobs"],
        streamed.meta_info["output_token_logprobs"],
    )
    assert [ids for _, ids, _ in got] == [ids for _, ids, _ in want]
    assert [lp for lp, _, _ in got] == pytest.approx([lp for lp, _, _ in want], rel=1e-5)
    assert (
        len(whole.meta_info["output_top_logprobs"])
        == len(streamed.meta_info["output_top_logprobs"])
        == 6
    )
    assert_empty(scheduler)


def test_stream_interval_groups_tokens():
    scheduler = create_scheduler(
        ServerArgs(
            load_format="dummy",
            max_total_tokens=256,
            max_running_requests=2,
            stream_interval=4,
            skip_tokenizer_init=True,
        )
    )
    scheduler.add_request("a", [1, 2, 3], {**GREEDY, "max_new_tokens": 10})
    outs = drain(scheduler)["a"]
    assert [len(o.new_token_ids) for o in outs] == [4, 4, 2] and outs[-1].finished


def test_throughput_meter_counts_the_recent_window():
    meter = ThroughputMeter(start=0.0, window_s=10.0)
    assert meter.rate(1.0) == 0.0
    meter.record(1.0, 30)
    assert meter.rate(2.0) == pytest.approx(15.0)  # 30 tokens in the 2 s since start
    meter.record(11.5, 20)
    assert meter.rate(12.0) == pytest.approx(
        2.0
    )  # the first event left the window: 20 tokens / 10 s


# ---- error isolation: a request's failure fails that request, a step's failure its batch, only a broken device
# ends the rank ----------------------------------------------------------------------------------------------------
POISONED_SEED = 13


def tokens_of(outputs: list) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def assert_failed_with(outputs: list, text: str, status: int = 500) -> None:
    reason = outputs[-1].meta_info["finish_reason"]
    assert outputs[-1].finished and reason["type"] == "abort" and reason["status_code"] == status, (
        reason
    )
    assert text in reason["message"], reason


def reference_tokens(scheduler, prompt: list[int]) -> list[int]:
    scheduler.add_request("reference", prompt, {**GREEDY, "max_new_tokens": 6})
    return tokens_of(drain(scheduler)["reference"])


def test_a_request_whose_sampling_raises_fails_alone(scheduler, monkeypatch):
    from sglang_lite.scheduler import sampling as sampling_module

    prompt = random_prompts([9], vocab=4000, seed=7)[0]
    reference = reference_tokens(scheduler, prompt)
    real_sample = sampling_module.sample

    def poisoned_sample(logits, params, generators, banned=None):
        if any(p.seed == POISONED_SEED for p in params):
            raise RuntimeError("probability tensor contains inf")
        return real_sample(logits, params, generators, banned)

    monkeypatch.setattr(sampling_module, "sample", poisoned_sample)
    scheduler.add_request("good", prompt, {**GREEDY, "max_new_tokens": 6})
    scheduler.add_request(
        "bad", prompt, {"max_new_tokens": 6, "temperature": 0.7, "seed": POISONED_SEED}
    )
    outputs = drain(scheduler)  # checks the invariants after every step
    assert tokens_of(outputs["good"]) == reference
    assert outputs["good"][-1].meta_info["finish_reason"]["type"] == "length"
    assert_failed_with(outputs["bad"], "RuntimeError: probability tensor contains inf")
    assert_empty(scheduler)


# a dead branch: "a" can start it, and then no character can follow (the grammar still admits "b", so it compiles)
DEAD_END_EBNF = 'root ::= "a" [^\\x00-\\U0010FFFF] | "b"'


def test_a_grammar_row_that_allows_no_token_fails_its_request_alone_with_a_400(scheduler):
    prompt = random_prompts([9], vocab=4000, seed=7)[0]
    reference = reference_tokens(scheduler, prompt)
    a = scheduler.tokenizer.encode("a", add_special_tokens=False)[0]
    scheduler.add_request("good", prompt, {**GREEDY, "max_new_tokens": 6})
    bad = {"max_new_tokens": 6, "ebnf": DEAD_END_EBNF, "logit_bias": {str(a): 100.0}}
    scheduler.add_request("bad", prompt, bad)
    outputs = drain(scheduler)  # checks the invariants after every step
    assert tokens_of(outputs["good"]) == reference
    assert_failed_with(outputs["bad"], "grammar allows no next token", status=400)
    assert tokens_of(outputs["bad"]) == [a]
    assert_empty(scheduler)


def test_a_request_whose_detokeniser_raises_fails_alone_mid_decode(scheduler):
    prompt = random_prompts([7], vocab=4000, seed=8)[0]
    reference = reference_tokens(scheduler, prompt)
    scheduler.add_request("good", prompt, {**GREEDY, "max_new_tokens": 6})
    scheduler.add_request("bad", prompt, {**GREEDY, "max_new_tokens": 6})
    outputs: dict[str, list] = {}
    drain_step(scheduler, outputs)  # both prefilled and decoding
    bad = next(r for r in scheduler.queues.running if r.rid == "bad")

    def broken_push(ids):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    bad.detokenizer.push = broken_push
    drain(scheduler, outputs)
    assert tokens_of(outputs["good"]) == reference
    assert_failed_with(outputs["bad"], "UnicodeDecodeError")
    assert_empty(scheduler)


def test_a_failing_forward_fails_its_batch_and_the_rank_goes_on(scheduler, monkeypatch):
    first, second = random_prompts([6, 12], vocab=4000, seed=9)
    reference = reference_tokens(scheduler, first)
    scheduler.add_request("survivor", first, {**GREEDY, "max_new_tokens": 6})
    outputs: dict[str, list] = {}
    drain_step(scheduler, outputs)  # the survivor decodes from now on
    real_forward = scheduler.runner.forward_batch
    calls = []

    def forward_failing_once(forward_batch, all_logits=False):
        calls.append(forward_batch)
        if len(calls) == 1:  # the prefill of "victim" alone: its KV slots are already allocated
            raise RuntimeError("a kernel raised")
        return real_forward(forward_batch, all_logits)

    monkeypatch.setattr(scheduler.runner, "forward_batch", forward_failing_once)
    # a greedy prefill's first token comes without the logits where the runner can: that path fails alike
    real_greedy = scheduler.runner.extend_greedy
    monkeypatch.setattr(
        scheduler.runner,
        "extend_greedy",
        lambda batch: forward_failing_once(batch) if not calls else real_greedy(batch),
    )
    scheduler.add_request("victim", second, {**GREEDY, "max_new_tokens": 6})
    drain_step(scheduler, outputs)
    assert_failed_with(outputs["victim"], "RuntimeError: a kernel raised")
    drain(scheduler, outputs)
    assert tokens_of(outputs["survivor"]) == reference
    assert_empty(scheduler)
    assert reference_tokens(scheduler, first) == reference  # the rank serves new requests as before


@pytest.fixture(scope="module")
def doomed_scheduler():
    """A scheduler that tests may leave broken."""
    return create_scheduler(
        ServerArgs(
            load_format="dummy",
            max_total_tokens=256,
            max_running_requests=2,
            context_length=64,
            skip_tokenizer_init=True,
        )
    )


def failing_forward(monkeypatch, scheduler, errors: list[BaseException]) -> None:
    """The next forwards raise ``errors`` in turn, a greedy prefill's first tokens (``extend_greedy``) too."""
    real_forward, real_greedy = scheduler.runner.forward_batch, scheduler.runner.extend_greedy

    def forward(forward_batch, all_logits=False):
        if errors:
            raise errors.pop(0)
        return real_forward(forward_batch, all_logits)

    def greedy(forward_batch):
        if errors:
            raise errors.pop(0)
        return real_greedy(forward_batch)

    monkeypatch.setattr(scheduler.runner, "forward_batch", forward)
    monkeypatch.setattr(scheduler.runner, "extend_greedy", greedy)


def test_out_of_memory_fails_the_batch_until_it_keeps_happening(doomed_scheduler, monkeypatch):
    from sglang_lite.scheduler.faults import MAX_MEMORY_FAILURES, RankBroken

    failing_forward(
        monkeypatch, doomed_scheduler, [MemoryError("out of memory")] * MAX_MEMORY_FAILURES
    )
    for i in range(MAX_MEMORY_FAILURES - 1):  # survivable: each batch fails alone
        doomed_scheduler.add_request(f"m{i}", [1, 2, 3], {**GREEDY, "max_new_tokens": 4})
        outputs = drain(doomed_scheduler)
        assert_failed_with(outputs[f"m{i}"], "MemoryError: out of memory")
        assert_empty(doomed_scheduler)
    doomed_scheduler.add_request("last", [1, 2, 3], {**GREEDY, "max_new_tokens": 4})
    with pytest.raises(RankBroken, match="3 steps in a row ran out of memory"):
        doomed_scheduler.step()


def test_a_cuda_error_breaks_the_rank(doomed_scheduler, monkeypatch):
    from sglang_lite.scheduler.faults import RankBroken

    doomed_scheduler.queues.waiting.clear()  # whatever the previous test left
    error = RuntimeError("CUDA error: an illegal memory access was encountered")
    failing_forward(monkeypatch, doomed_scheduler, [error])
    doomed_scheduler.add_request("x", [1, 2, 3], {**GREEDY, "max_new_tokens": 4})
    with pytest.raises(RankBroken, match="illegal memory access"):
        doomed_scheduler.step()
