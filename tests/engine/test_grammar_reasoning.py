"""A grammar after the reasoning (``require_reasoning``, with a reasoning parser): the output is free until it ends
with ``</think>`` as the tokenizer encodes it, then the grammar constrains the answer; an output that never closes
its reasoning is never constrained. The built-in tokenizer spells ``</think>`` in five tokens, so the end is a
token sequence (Qwen3.5's is one token)."""

from __future__ import annotations

import json

import pytest
import torch

from sglang_lite import Engine
from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.protocol.requests import validate_request
from sglang_lite.sampling import SamplingParams
from sglang_lite.sampling.grammar import (
    GrammarKey,
    ReasoningGrammar,
    RequestGrammar,
    check_some_token_allowed,
    keep_possible_bans,
    mask_logits,
    reasoning_end_ids,
)
from tests.engine.test_structured_output import SCHEMA, matches_schema

VOCAB = 4096
EOS = 4095


@pytest.fixture(scope="module")
def end(tokenizer) -> tuple[int, ...]:
    ids = reasoning_end_ids(tokenizer, "qwen3")
    assert tokenizer.decode(list(ids)) == "</think>" and len(ids) > 1
    return ids


def schema_grammar(cache, end) -> ReasoningGrammar:
    compiled = cache.compile(GrammarKey("json_schema", json.dumps(SCHEMA)))
    return ReasoningGrammar(RequestGrammar(compiled, [EOS]), end)


def test_the_reasoning_is_free_and_the_answer_follows_the_grammar(cache, tokenizer, end):
    grammar = schema_grammar(cache, end)
    generator = torch.Generator().manual_seed(0)
    # reasoning that holds pieces of the end and a broken end before the real one
    reasoning = tokenizer.encode("I think < / think > then", add_special_tokens=False)
    for token in [*reasoning, *end[:3], *reasoning, *end]:
        logits = torch.randn(1, VOCAB, generator=generator)
        assert mask_logits(logits, [grammar]) is logits, "no mask while reasoning"
        check_some_token_allowed(logits, [grammar])
        assert keep_possible_bans(logits, [[EOS]], [grammar]) == [[EOS]]
        assert not grammar.active and not grammar.terminated
        grammar.accept(token)
    assert grammar.active
    answer = []
    while not grammar.terminated:
        assert len(answer) < 300, tokenizer.decode(answer)
        logits = mask_logits(torch.randn(1, VOCAB, generator=generator), [grammar])
        token = int(torch.argmax(logits))
        grammar.accept(token)
        answer.append(token)
    assert answer[-1] == EOS and matches_schema(json.loads(tokenizer.decode(answer[:-1])))


def test_an_active_grammar_masks_as_the_plain_grammar_does(cache, end):
    grammar = schema_grammar(cache, end)
    plain = RequestGrammar(cache.compile(GrammarKey("json_schema", json.dumps(SCHEMA))), [EOS])
    for token in end:
        grammar.accept(token)
    logits = torch.randn(2, VOCAB)
    assert torch.equal(mask_logits(logits, [grammar, None]), mask_logits(logits, [plain, None]))


def test_the_end_is_found_where_it_overlaps_itself(cache):
    """An end sequence (1, 1, 2) after 1, 1, 1: the last two 1s still start it."""
    plain = RequestGrammar(cache.compile(GrammarKey("regex", "a")), [EOS])
    grammar = ReasoningGrammar(plain, (1, 1, 2))
    for token in (1, 1, 1):
        grammar.accept(token)
        assert not grammar.active
    grammar.accept(2)
    assert grammar.active


def test_a_parallel_sample_starts_in_the_reasoning(cache, end):
    grammar = schema_grammar(cache, end)
    fork = grammar.restarted()
    for token in end:
        grammar.accept(token)
    assert grammar.active and not fork.active and fork.end_ids == end


def test_require_reasoning_needs_a_reasoning_parser():
    config = SchedulerConfig(1024, 4, 256, 64, 64, VOCAB)
    params = SamplingParams(regex="[0-9]+", require_reasoning=True)
    with pytest.raises(ValueError, match="require_reasoning needs a reasoning parser"):
        validate_request([1, 2], params, config, True)
    with_parser = SchedulerConfig(1024, 4, 256, 64, 64, VOCAB, think_end_ids=(5, 6))
    validate_request([1, 2], params, with_parser, True)
    with pytest.raises(ValueError, match="require_reasoning"):
        SamplingParams(require_reasoning="yes").validate(VOCAB)


# ---- an Engine with a reasoning parser ---------------------------------------------------------------------------
PROMPT = "<|im_start|>user\nJSON please<|im_end|>\n<|im_start|>assistant\n<think>\n"


@pytest.fixture(scope="module")
def engine():
    with Engine(
        load_format="dummy",
        max_total_tokens=2048,
        max_running_requests=8,
        context_length=256,
        reasoning_parser="qwen3",
    ) as engine:
        yield engine


def test_reasoning_that_never_ends_is_never_constrained(engine):
    """Random weights do not write </think> within 24 tokens: the output is what it is without a grammar, cut
    by the length limit (a reasoning parser makes all of it reasoning_content)."""
    free = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    plain = engine.generate(PROMPT, free)
    assert "</think>" not in plain["text"]
    for grammar in ({"regex": "[0-9]{3}"}, {"json_schema": json.dumps(SCHEMA)}):
        result = engine.generate(PROMPT, {**free, **grammar, "require_reasoning": True})
        assert result["output_ids"] == plain["output_ids"]
        assert result["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    constrained = engine.generate(PROMPT, {**free, "regex": "[0-9]{3}"})
    assert constrained["text"].isdigit(), "without require_reasoning the grammar starts at once"


def test_parallel_samples_each_start_in_their_reasoning(engine):
    params = {"max_new_tokens": 12, "temperature": 1.0, "seed": 5, "n": 3, "ignore_eos": True}
    plain = engine.generate(PROMPT, params)
    constrained = engine.generate(PROMPT, {**params, "regex": "x", "require_reasoning": True})
    assert [r["output_ids"] for r in constrained] == [r["output_ids"] for r in plain]
