"""Grammars too expensive to follow (``sampling/grammar_cost.py``): a token mask or an accepted token past
``--grammar-mask-budget-ms`` of CPU fails its own request with a 400, on a rank (the rank's other requests go on, its
pools end clean) and in the HTTP side's checker processes (before any rank meets it).

No outcome here depends on the machine's speed: a slow mask is a matcher that spends a fixed CPU time, or the
growing regex ``(.*){1,32000}[bc]`` (hundreds of ms a mask) against a budget of 1 ms; plain grammars are held to
budgets thousands of times their cost."""

from __future__ import annotations

import json
import re
import time

import pytest

from sglang_lite.runtime.factory import create_scheduler
from sglang_lite.sampling.grammar import GrammarKey
from sglang_lite.sampling.grammar_cost import GrammarTooExpensive, MaskBudget, check_mask_cost
from sglang_lite.sampling.grammar_process import GrammarChecker, xgrammar_tables
from sglang_lite.server_args import ServerArgs
from tests.engine.conftest import random_prompts
from tests.engine.test_scheduler import (
    GREEDY,
    assert_empty,
    assert_failed_with,
    drain,
    tokens_of,
)

VOCAB = 4096  # the built-in model's
GROWING = "(.*){1,32000}[bc]"  # compiles in well under a second; its masks then take longer with every token
PLAIN_REGEX = "[0-9]{1,4}"


def spend_cpu(seconds: float) -> None:
    """Burns ``seconds`` of this thread's CPU time (what the budget counts), however fast the machine."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


class CostlyMatcher:
    """xgrammar's matcher whose masks, after the first ``cheap`` ones, each spend ``seconds`` of CPU first: a
    grammar whose cost grows as its output does."""

    def __init__(self, matcher, seconds: float, cheap: int) -> None:
        self.matcher = matcher
        self.seconds = seconds
        self.cheap = cheap
        self.fills = 0

    def fill_next_token_bitmask(self, bitmask, row: int) -> None:
        self.fills += 1
        if self.fills > self.cheap:
            spend_cpu(self.seconds)
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def __getattr__(self, name: str):
        return getattr(self.matcher, name)


def small_scheduler(mask_budget_ms: float):
    return create_scheduler(
        ServerArgs(
            load_format="dummy",
            max_total_tokens=512,
            max_running_requests=4,
            chunked_prefill_size=8,
            max_prefill_tokens=16,
            context_length=128,
            grammar_mask_budget_ms=mask_budget_ms,
        )
    )


# ---- the budget ------------------------------------------------------------------------------------------------------
def test_an_operation_past_the_budget_raises_and_every_later_one_raises_without_running():
    budget = MaskBudget(0.01)
    with budget.timed("a token mask"):
        pass  # well within
    with pytest.raises(
        GrammarTooExpensive, match=r"a token mask took \d+ ms of CPU, more than the 10 ms"
    ):
        with budget.timed("a token mask"):
            spend_cpu(0.03)
    ran = []
    with pytest.raises(GrammarTooExpensive, match="too expensive to follow"):
        with budget.timed("accepting a token"):
            ran.append(True)
    assert ran == [], "a grammar that overran is not run again"


def test_no_budget_never_raises():
    budget = MaskBudget(None)
    with budget.timed("a token mask"):
        spend_cpu(0.02)
    assert budget.overrun is None


# ---- on a rank -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scheduler():
    return small_scheduler(mask_budget_ms=50)


def test_a_mask_past_the_budget_fails_its_request_alone_with_a_400(scheduler, monkeypatch):
    prompt = random_prompts([9], vocab=4000, seed=7)[0]
    scheduler.add_request("reference", prompt, {**GREEDY, "max_new_tokens": 8})
    reference = tokens_of(drain(scheduler)["reference"])
    costly: list[CostlyMatcher] = []
    grammar_of = scheduler.intake.grammar_of

    def with_costly_masks(req, compiled):
        grammar = grammar_of(req, compiled)
        if req.rid == "costly":  # two cheap masks, then each spends 0.2 s, four times the budget
            costly.append(CostlyMatcher(grammar._matcher, seconds=0.2, cheap=2))
            grammar._matcher = costly[0]
        return grammar

    monkeypatch.setattr(scheduler.intake, "grammar_of", with_costly_masks)
    scheduler.add_request("plain", prompt, {**GREEDY, "max_new_tokens": 8})
    scheduler.add_request("regex", prompt, {"max_new_tokens": 8, "regex": PLAIN_REGEX})
    scheduler.add_request("costly", prompt, {"max_new_tokens": 8, "regex": "[a-z ]{1,40}"})
    outputs = drain(scheduler)  # checks the pool invariants after every step
    assert tokens_of(outputs["plain"]) == reference
    assert outputs["plain"][-1].meta_info["finish_reason"]["type"] == "length"
    assert re.fullmatch(PLAIN_REGEX, "".join(out.new_text for out in outputs["regex"]))
    assert outputs["regex"][-1].meta_info["finish_reason"]["type"] in ("stop", "length")
    assert_failed_with(outputs["costly"], "the request's grammar is too expensive to follow", 400)
    assert "--grammar-mask-budget-ms" in outputs["costly"][-1].meta_info["finish_reason"]["message"]
    assert len(tokens_of(outputs["costly"])) == 2, "the tokens of its two cheap masks"
    assert costly[0].fills == 3, (
        "the slow mask was paid once, not again when the batch was re-sampled"
    )
    assert_empty(scheduler)


def test_the_growing_regex_fails_on_a_rank_with_a_small_budget(tokenizer):
    scheduler = small_scheduler(mask_budget_ms=1)
    prompt = random_prompts([9], vocab=4000, seed=11)[0]
    scheduler.add_request("plain", prompt, {**GREEDY, "max_new_tokens": 6})
    scheduler.add_request("growing", prompt, {"max_new_tokens": 6, "regex": GROWING})
    outputs = drain(scheduler)
    assert outputs["plain"][-1].meta_info["finish_reason"]["type"] == "length"
    assert len(tokens_of(outputs["plain"])) == 6
    assert_failed_with(outputs["growing"], "grammar is too expensive to follow: a token mask", 400)
    assert_empty(scheduler)


# ---- before a rank: the checker processes ---------------------------------------------------------------------------
def test_following_the_first_tokens_refuses_the_growing_regex_and_passes_plain_grammars(cache):
    with pytest.raises(ValueError, match="sampling parameter regex is too expensive to follow"):
        check_mask_cost(cache.compile(GrammarKey("regex", GROWING)), "regex", budget_s=0.001)
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
    for key in [
        GrammarKey("regex", PLAIN_REGEX),
        GrammarKey("json_schema", json.dumps(schema)),
        GrammarKey("ebnf", 'root ::= "a" root | "b"'),
    ]:
        check_mask_cost(cache.compile(key), key.kind, budget_s=1.0)


def test_a_checker_process_refuses_a_grammar_whose_masks_overrun(tokenizer):
    checker = GrammarChecker(
        lambda: xgrammar_tables(tokenizer, VOCAB), budget_s=60.0, workers=1, mask_budget_s=0.001
    )
    try:
        with pytest.raises(ValueError, match="sampling parameter regex is too expensive to follow"):
            checker.submit(GrammarKey("regex", GROWING)).result(120)
        assert checker.killed == 0, "refused by the mask budget, not killed past the compile budget"
    finally:
        checker.shutdown()
