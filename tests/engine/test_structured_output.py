"""Structured output: the grammar cache, masks and matchers (no model), then the offline Engine on the built-in tiny
model with random weights, whose outputs must still parse and match their JSON schema, regex or EBNF."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch

from sglang_lite import Engine
from sglang_lite.sampling import SamplingParams
from sglang_lite.sampling.grammar import (
    GrammarCache,
    GrammarKey,
    GrammarQueue,
    RequestGrammar,
    keep_possible_bans,
    mask_logits,
)

VOCAB = 4096  # the built-in model's
EOS = 4095
# small, quick to finish: random weights babble inside free strings, so they are bounded
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "name": {"type": "string", "maxLength": 6},
    },
    "required": ["ok", "color", "count", "name"],
}
REGEX = r"(yes|no), [0-9]{1,3}!"
EBNF = 'root ::= "let " name " = " digit+ ";"\nname ::= [a-z] [a-z]? [a-z]?\ndigit ::= [0-9]'
EBNF_MATCH = re.compile(r"let [a-z]{1,3} = [0-9]+;")


def matches_schema(value: object) -> bool:
    """SCHEMA, checked by hand."""
    return (
        isinstance(value, dict)
        and set(value) == set(SCHEMA["required"])
        and isinstance(value["ok"], bool)
        and value["color"] in ("red", "green", "blue")
        and isinstance(value["count"], int)
        and not isinstance(value["count"], bool)
        and 0 <= value["count"] <= 99
        and isinstance(value["name"], str)
        and len(value["name"]) <= 6
    )


# ---- the grammar module ------------------------------------------------------------------------------------------
def test_a_grammar_compiles_once_per_text(cache):
    key = GrammarKey("json_schema", json.dumps(SCHEMA))
    first = cache.compile(key)
    assert cache.compile(GrammarKey("json_schema", json.dumps(SCHEMA))) is first
    assert cache.compile(GrammarKey("json_schema", '{"type": "object"}')) is not first


def test_the_cache_forgets_the_least_recently_used(tokenizer):
    cache = GrammarCache(tokenizer, VOCAB, max_entries=2)
    a, b, c = (GrammarKey("regex", r) for r in ("a", "b", "c"))
    first_a = cache.compile(a)
    cache.compile(b)
    cache.compile(a)  # a is now the most recent
    cache.compile(c)  # b goes
    assert cache.compile(a) is first_a
    assert cache.compile(b) is not None
    cache.shutdown()


class SlowCompiles:
    """Stands in for xgrammar's compile of the ``slow`` regexes: blocks until released (a huge schema)."""

    def __init__(self, cache: GrammarCache) -> None:
        self.release = threading.Event()
        self.started: list[str] = []
        self._real = cache._compile

    def __call__(self, compiler, key: GrammarKey):
        if key.text.startswith("slow"):
            self.started.append(key.text)
            self.release.wait(60)
        return self._real(compiler, key)


def wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_compile_past_its_budget_fails_as_too_complex_and_frees_its_slot(tokenizer, monkeypatch):
    cache = GrammarCache(tokenizer, VOCAB, budget_s=0.2)
    slow = SlowCompiles(cache)
    monkeypatch.setattr(cache, "_compile", slow)
    try:
        stuck = [cache.submit(GrammarKey("regex", f"slow{i}")) for i in range(2)]  # both slots
        for future in stuck:
            with pytest.raises(
                ValueError, match="regex is too complex: it did not compile within 0.2 s"
            ):
                future.result(timeout=30)
        assert cache.compile(GrammarKey("regex", "[0-9]+")) is not None  # while both still run
        assert cache.abandoned == 2 and not slow.release.is_set()
        again = cache.submit(
            GrammarKey("regex", "slow0")
        )  # the failure is cached: no second compile
        assert again is stuck[0] and slow.started.count("slow0") == 1
    finally:
        slow.release.set()
        cache.shutdown()


def test_grammars_beyond_the_queue_bound_are_refused_as_busy(tokenizer, monkeypatch):
    from sglang_lite.sampling.grammar import GrammarBusy

    cache = GrammarCache(tokenizer, VOCAB, max_queued=1)
    slow = SlowCompiles(cache)
    monkeypatch.setattr(cache, "_compile", slow)
    try:
        running = []
        for i in range(
            2
        ):  # both slots taken, one after the other (each leaves the queue when it starts)
            running.append(cache.submit(GrammarKey("regex", f"slow{i}")))
            wait_until(lambda: len(slow.started) == len(running))
        waiting = cache.submit(GrammarKey("regex", "a"))
        with pytest.raises(GrammarBusy, match="1 grammars are waiting to compile"):
            cache.submit(GrammarKey("regex", "b"))
        slow.release.set()
        assert waiting.result(timeout=30) is not None
        assert all(f.result(timeout=30) is not None for f in running)
    finally:
        slow.release.set()
        cache.shutdown()


@pytest.mark.parametrize(
    "kind,text,needle",
    [
        ("regex", "(ab", "parenthesis"),
        ("json_schema", "{not json", "JSON"),
        ("json_schema", '{"type": 5}', "Type should be a string"),
        ("ebnf", "root ::= missing", "missing"),
        ("ebnf", "root ::= (", "EBNF"),
    ],
)
def test_a_grammar_that_cannot_compile_is_a_value_error_naming_its_field(cache, kind, text, needle):
    with pytest.raises(
        ValueError, match=rf"^sampling parameter {kind} does not compile: "
    ) as error:
        cache.compile(GrammarKey(kind, text))
    message = str(error.value)
    assert needle in message and "/project/" not in message and ".cc:" not in message, message
    with pytest.raises(ValueError, match=kind):  # a failure is cached too, and raises again
        cache.compile(GrammarKey(kind, text))


@pytest.mark.parametrize(
    "params,needle",
    [
        ({"json_schema": "{}", "regex": "a"}, "json_schema, regex: at most one"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "regex, ebnf: at most one"),
        ({"regex": ""}, "regex"),
        ({"ebnf": 5}, "ebnf"),
        ({"json_schema": "x" * 70000}, "json_schema"),
        ({"regex": "\ud800"}, "regex"),
    ],
)
def test_bad_grammar_parameters_name_their_field(params, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        SamplingParams.from_dict(params).validate(VOCAB)


def allowed(logits_row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(logits_row > float("-inf")).flatten().tolist())


def test_masks_touch_only_grammar_rows_and_match_the_bitmask(cache, tokenizer):
    logits = torch.randn(3, VOCAB)
    grammar = RequestGrammar(cache.compile(GrammarKey("regex", "(yes|no)")), [EOS])
    masked = mask_logits(logits, [None, grammar, None])
    assert masked is not logits and torch.isfinite(logits).all(), (
        "the forward's logits stay as they were"
    )
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    texts = {tokenizer.decode([t]) for t in allowed(masked[1])}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    kept = allowed(masked[1])
    assert torch.equal(masked[1, sorted(kept)], logits[1, sorted(kept)]), "allowed logits are exact"
    assert mask_logits(logits, [None, None]) is logits


def test_a_matcher_ends_at_the_stop_token_once_complete(cache, tokenizer):
    grammar = RequestGrammar(cache.compile(GrammarKey("regex", "no")), [EOS])
    for token in tokenizer.encode("no"):
        assert not grammar.terminated
        grammar.accept(token)
    assert allowed(mask_logits(torch.zeros(1, VOCAB), [grammar])[0]) == {EOS}, (
        "complete: only the stop token"
    )
    grammar.accept(EOS)
    assert grammar.terminated


def test_a_token_the_grammar_forbids_is_refused(cache, tokenizer):
    grammar = RequestGrammar(cache.compile(GrammarKey("regex", "no")), [EOS])
    with pytest.raises(ValueError, match="breaks the request's grammar"):
        grammar.accept(tokenizer.encode("yes")[0])


def test_a_ban_that_leaves_no_allowed_token_is_lifted(cache, tokenizer):
    grammar = RequestGrammar(cache.compile(GrammarKey("regex", "no")), [EOS])
    for token in tokenizer.encode("no"):
        grammar.accept(token)
    logits = mask_logits(torch.zeros(2, VOCAB), [grammar, None])
    assert keep_possible_bans(logits, [[EOS], [EOS]], [grammar, None]) == [[], [EOS]]
    fresh = RequestGrammar(cache.compile(GrammarKey("regex", "no")), [EOS])
    logits = mask_logits(torch.zeros(1, VOCAB), [fresh])
    assert keep_possible_bans(logits, [[EOS]], [fresh]) == [[EOS]]


def test_the_queue_hands_out_compiled_grammars_and_errors(cache):
    queue = GrammarQueue(cache, wait=True)
    queue.add("good", GrammarKey("regex", "[0-9]+"))
    queue.add("bad", GrammarKey("regex", "[0-9"))
    queue.add("gone", GrammarKey("regex", "x"))
    queue.remove("gone")
    assert queue.items == ["good", "bad"]
    (good, compiled), (bad, error) = queue.take_ready()
    assert (good, bad) == ("good", "bad") and len(queue) == 0
    assert isinstance(error, ValueError) and "regex" in str(error)
    RequestGrammar(compiled, [EOS])


def test_a_queue_that_does_not_wait_takes_only_finished_compiles(cache):
    queue = GrammarQueue(cache)
    queue.add("r", GrammarKey("regex", "[a-c]{2}"))
    deadline = time.monotonic() + 30
    taken = []
    while not taken and time.monotonic() < deadline:
        taken = queue.take_ready()
    assert [item for item, _ in taken] == ["r"] and len(queue) == 0


# ---- the engine ------------------------------------------------------------------------------------------------
PROMPT = "def read_config(path):\n"


@pytest.fixture(scope="module")
def engine():
    with Engine(
        load_format="dummy", max_total_tokens=2048, max_running_requests=8, context_length=512
    ) as engine:
        yield engine


def texts(results: list[dict]) -> list[str]:
    return [r["text"] for r in results]


def test_json_schema_outputs_parse_and_match(engine):
    schema = json.dumps(SCHEMA)
    params = [
        {"json_schema": schema, "temperature": 1.0, "seed": s, "max_new_tokens": 120}
        for s in range(4)
    ]
    params.append({"json_schema": schema, "temperature": 0.0, "max_new_tokens": 120})
    results = engine.generate([PROMPT] * len(params), params)
    for result in results:
        assert result["meta_info"]["finish_reason"]["type"] == "stop", result
        assert matches_schema(json.loads(result["text"])), result["text"]


def test_any_json_object_parses_when_it_ends(engine):
    """``{"type": "object"}`` (OpenAI's json_object) leaves keys free, where random weights may babble on: the
    outputs that end are objects, the others are cut objects."""
    params = [
        {"json_schema": '{"type": "object"}', "temperature": 1.0, "seed": s, "max_new_tokens": 40}
        for s in range(8)
    ]
    results = engine.generate([PROMPT] * len(params), params)
    ended = [r for r in results if r["meta_info"]["finish_reason"]["type"] == "stop"]
    assert ended, [r["text"] for r in results]
    assert all(isinstance(json.loads(r["text"]), dict) for r in ended)
    assert all(r["text"].startswith("{") for r in results)


def test_regex_and_ebnf_outputs_match(engine):
    params = [
        {"regex": REGEX, "temperature": 1.0, "seed": 8, "max_new_tokens": 40},
        {"regex": REGEX, "temperature": 0.0, "max_new_tokens": 40},
        {"ebnf": EBNF, "temperature": 1.0, "seed": 9, "max_new_tokens": 40},
        {"ebnf": EBNF, "temperature": 0.0, "max_new_tokens": 40},
    ]
    results = engine.generate([PROMPT] * len(params), params)
    for result, pattern in zip(results, [REGEX, REGEX, EBNF_MATCH.pattern, EBNF_MATCH.pattern]):
        assert re.fullmatch(pattern, result["text"]), (pattern, result["text"])
        assert result["meta_info"]["finish_reason"]["type"] == "stop"


def test_free_requests_are_unchanged_beside_grammar_requests(engine):
    free = [
        {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True},
        {"temperature": 1.0, "seed": 3, "max_new_tokens": 12, "ignore_eos": True},
    ]
    alone = engine.generate([PROMPT, "import os\n"], free)
    grammar = [
        {"regex": REGEX, "temperature": 0.0, "max_new_tokens": 40},
        {"json_schema": json.dumps(SCHEMA), "temperature": 1.0, "seed": 1, "max_new_tokens": 120},
    ]
    mixed = engine.generate(
        [PROMPT, PROMPT, "import os\n", PROMPT], [free[0], grammar[0], free[1], grammar[1]]
    )
    assert [r["output_ids"] for r in (mixed[0], mixed[2])] == [r["output_ids"] for r in alone]
    assert re.fullmatch(REGEX, mixed[1]["text"]) and matches_schema(json.loads(mixed[3]["text"]))


def test_ignore_eos_still_ends_where_the_grammar_ends(engine):
    result = engine.generate(
        PROMPT,
        {"regex": REGEX, "temperature": 1.0, "seed": 4, "ignore_eos": True, "max_new_tokens": 60},
    )
    assert re.fullmatch(REGEX, result["text"]), result["text"]
    reason = result["meta_info"]["finish_reason"]
    assert reason["type"] == "stop" and reason["matched"] in engine.config.eos_token_ids, reason


def test_min_new_tokens_gives_way_to_a_complete_grammar(engine):
    result = engine.generate(
        PROMPT,
        {"regex": "ok", "temperature": 1.0, "seed": 5, "min_new_tokens": 10, "max_new_tokens": 20},
    )
    assert result["text"] == "ok" and result["meta_info"]["finish_reason"]["type"] == "stop"


def test_a_grammar_cut_by_max_new_tokens_ends_with_length(engine):
    result = engine.generate(
        PROMPT, {"json_schema": json.dumps(SCHEMA), "temperature": 0.0, "max_new_tokens": 3}
    )
    assert result["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert result["text"].startswith("{")


@pytest.mark.parametrize(
    "params,needle",
    [
        ({"regex": "[0-9"}, "sampling parameter regex does not compile"),
        (
            {"json_schema": '{"type": "object", "properties": 3}'},
            "sampling parameter json_schema does not compile",
        ),
        ({"ebnf": "root ::= nothing"}, "sampling parameter ebnf does not compile"),
    ],
)
def test_a_bad_grammar_raises_and_sends_nothing(engine, params, needle):
    with pytest.raises(ValueError, match=needle):
        engine.generate([PROMPT, PROMPT], [{"max_new_tokens": 2}, params])
    assert engine.generate(PROMPT, {"regex": "[0-9]{2}", "max_new_tokens": 8})["text"].isdigit()


# ---- the scheduler: the grammar queue, retraction ------------------------------------------------------------------
def run_all(scheduler, timeout_s: float = 120.0) -> dict[str, list]:
    """Steps until idle (steps with nothing to run while grammars compile are instant: a deadline, not a count)."""
    outputs: dict[str, list] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not scheduler.has_work:
            return outputs
        for out in scheduler.step():
            outputs.setdefault(out.rid, []).append(out)
        scheduler.check_invariants()
    raise AssertionError("the scheduler did not finish")


def text_of(outputs: list) -> str:
    return "".join(o.new_text for o in outputs)


@pytest.fixture(scope="module")
def small_scheduler():
    from sglang_lite.runtime.factory import create_scheduler
    from sglang_lite.server_args import ServerArgs

    return create_scheduler(
        ServerArgs(
            load_format="dummy",
            max_total_tokens=256,
            max_running_requests=6,
            context_length=128,
            schedule_conservativeness=0.0,
        )
    )


def test_retracted_grammar_requests_resume_where_their_grammar_was(small_scheduler):
    """The KV pool holds about half of what six requests need (a digit is a token; admission reserves nothing): the
    newest are retracted and re-prefilled with their output; their matchers keep every accepted token (none is
    accepted twice)."""
    prompts = [small_scheduler.tokenizer.encode(f"def f{i}(a, b):\n    return") for i in range(6)]
    for i, prompt in enumerate(prompts):
        small_scheduler.add_request(
            f"r{i}",
            prompt,
            {"regex": "[0-9]{60}", "temperature": 1.0, "seed": i, "max_new_tokens": 100},
        )
    outputs = run_all(small_scheduler)
    assert small_scheduler.decode.num_retractions > 0
    for i in range(6):
        assert re.fullmatch("[0-9]{60}", text_of(outputs[f"r{i}"])), outputs[f"r{i}"][-1].meta_info
        assert outputs[f"r{i}"][-1].meta_info["finish_reason"]["type"] == "stop"


def test_a_request_aborted_while_its_grammar_compiles_ends_there(small_scheduler):
    prompt = small_scheduler.tokenizer.encode("x =")
    small_scheduler.add_request("slow", prompt, {"regex": "[0-7]{3}z", "max_new_tokens": 8})
    assert small_scheduler.has_work and small_scheduler.grammar_queue.items[0].rid == "slow"
    assert small_scheduler.abort("slow")
    assert len(small_scheduler.grammar_queue) == 0 and not small_scheduler.queues.waiting
    outputs = run_all(small_scheduler)
    assert outputs["slow"][-1].meta_info["finish_reason"]["type"] == "abort"


def test_a_grammar_that_fails_on_the_rank_fails_its_request_alone(small_scheduler):
    """Front ends refuse what cannot compile; a request sent straight to a rank fails alone (500)."""
    prompt = small_scheduler.tokenizer.encode("x =")
    small_scheduler.add_request("bad", prompt, {"regex": "[0-", "max_new_tokens": 8})
    small_scheduler.add_request("good", prompt, {"regex": "[0-7]{3}", "max_new_tokens": 8})
    outputs = run_all(small_scheduler)
    reason = outputs["bad"][-1].meta_info["finish_reason"]
    assert (
        reason["type"] == "abort" and reason["status_code"] == 500 and "regex" in reason["message"]
    ), reason
    assert re.fullmatch("[0-7]{3}", text_of(outputs["good"]))


def test_a_grammar_needs_a_tokenizer():
    from sglang_lite.runtime.factory import create_scheduler
    from sglang_lite.server_args import ServerArgs

    scheduler = create_scheduler(
        ServerArgs(
            load_format="dummy",
            max_total_tokens=128,
            max_running_requests=2,
            context_length=64,
            skip_tokenizer_init=True,
        )
    )
    with pytest.raises(ValueError, match="sampling parameter regex needs a tokenizer"):
        scheduler.add_request("r", [1, 2], {"regex": "a"})


def test_parallel_samples_each_follow_the_grammar(engine):
    """n > 1: every forked sample gets the grammar from its start, with its own seed."""
    params = {"regex": REGEX, "temperature": 1.0, "seed": 21, "max_new_tokens": 40, "n": 4}
    results = engine.generate(PROMPT, params)
    assert len(results) == 4
    for result in results:
        assert re.fullmatch(REGEX, result["text"]), result["text"]
