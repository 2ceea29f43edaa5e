"""The reasoning and tool-call parsers: whole text and any split into deltas agree; tags split across deltas;
garbage stays text and never raises; parameter values take their schema's types."""

from __future__ import annotations

import json
import random

import pytest

from sglang_lite.server.parsers import TOOL_CALL_PARSERS, ParsedText, ParsingPlan, join_tool_calls
from sglang_lite.server.parsers.reasoning import prompt_opens_reasoning
from sglang_lite.server.parsers.tool_calls import convert_parameter
from sglang_lite.server_args import REASONING_PARSERS
from sglang_lite.server_args import TOOL_CALL_PARSERS as FLAG_TOOL_CALL_PARSERS

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "metric": {"type": "boolean"},
            "hours": {"type": "array"},
            "where": {"type": "object"},
            "code": {"type": "string"},
        },
    },
}
TOOLS = (WEATHER, {"name": "noop"})
CODER_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
    "</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n"
    "<parameter=code>\n007\n</parameter>\n</function>\n</tool_call>"
)
CODER_ARGS = {"city": "Paris", "days": 3, "metric": True, "hours": [1, 2], "code": "007"}
TEXTS = [
    "Let me think.\n</think>\n\nI will check.\n\n" + CODER_CALL,
    "</think>" + CODER_CALL + "\n" + CODER_CALL.replace("Paris", "Rome"),
    "thinking forever, cut by max_tokens <tool_call>",
    "\n</think>\n\nplain answer < with <tool_ and <think> inside\n",
    "x</think>y<tool_call>\n<function=unknown>\n</function>\n</tool_call>z",
    "</think><tool_call><tool_call>\n<function=noop>\n</function>\n</tool_call>",
    "</think>" + CODER_CALL[:60],  # cut inside a committed call
    "</think><tool_call>garbage</tool_call><tool_call>\n\n",
    "",
]


def parse_in_pieces(plan: ParsingPlan, text: str, rng: random.Random) -> ParsedText:
    parser, out, i = plan.new(), ParsedText(), 0
    while i < len(text):
        size = rng.randint(1, 7)
        out += parser.feed(text[i : i + size])
        i += size
    out += parser.finish()
    return out


def summary(parsed: ParsedText) -> tuple:
    return (
        parsed.reasoning,
        parsed.content,
        [(c.name, c.arguments) for c in join_tool_calls(parsed.tool_calls)],
    )


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize(
    "plan",
    [
        ParsingPlan(True, True, "qwen3_coder", TOOLS),
        ParsingPlan(True, False, None),
        ParsingPlan(False, False, "qwen3_coder", TOOLS),
    ],
)
def test_deltas_of_any_size_give_the_whole_text_result(plan: ParsingPlan, text: str) -> None:
    whole = summary(plan.new().parse(text))
    for seed in range(30):
        assert summary(parse_in_pieces(plan, text, random.Random(seed))) == whole


def test_reasoning_then_answer_then_call() -> None:
    reasoning, content, calls = summary(
        ParsingPlan(True, True, "qwen3_coder", TOOLS).new().parse(TEXTS[0])
    )
    assert (reasoning, content) == ("Let me think.", "I will check.")
    assert [(name, json.loads(args)) for name, args in calls] == [("get_weather", CODER_ARGS)]


def test_two_calls_are_two_indices_with_ids() -> None:
    parsed = ParsingPlan(True, True, "qwen3_coder", TOOLS).new().parse(TEXTS[1])
    calls = join_tool_calls(parsed.tool_calls)
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    assert (
        parsed.content == ""
        and all(c.id.startswith("call_") for c in calls)
        and calls[0].id != calls[1].id
    )
    first = [d for d in parsed.tool_calls if d.index == 0]
    assert (
        first[0].name == "get_weather" and first[0].arguments == ""
    )  # the name streams before the arguments


def test_unclosed_reasoning_is_all_reasoning() -> None:
    assert summary(ParsingPlan(True, True, "qwen3_coder", TOOLS).new().parse(TEXTS[2])) == (
        TEXTS[2],
        "",
        [],
    )


def test_prompt_without_open_think_starts_in_the_answer() -> None:
    plan = ParsingPlan(True, False, None)
    assert summary(plan.new().parse("<think>a</think>b")) == ("a", "b", [])
    assert summary(plan.new().parse("an answer </think> here")) == (
        "",
        "an answer </think> here",
        [],
    )
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize(
    "text",
    [
        TEXTS[4],
        TEXTS[7],
        "<tool_call>\n<function=get_weather",
        "<tool_call" * 3,
        "<tool_call>\n" + " " * 100 + "<function=noop></function></tool_call>",
    ],
)
def test_blocks_that_are_not_calls_stay_text(text: str) -> None:
    parsed = ParsingPlan(False, False, "qwen3_coder", TOOLS).new().parse(text)
    assert parsed.tool_calls == [] and parsed.content == text.replace("</think>", "</think>")


def test_a_call_cut_by_the_length_limit_keeps_its_complete_parameters() -> None:
    cut = CODER_CALL[: CODER_CALL.index("<parameter=metric>") + 24]  # inside metric's value
    parsed = ParsingPlan(False, False, "qwen3_coder", TOOLS).new().parse(cut)
    (call,) = join_tool_calls(parsed.tool_calls)
    assert json.loads(call.arguments) == {"city": "Paris", "days": 3}


def test_qwen25_json_calls() -> None:
    plan = ParsingPlan(False, False, "qwen25", TOOLS)
    text = (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
        '\n<tool_call>\n{"name": "noop", "arguments": "{}"}\n</tool_call>'
    )
    whole = summary(plan.new().parse(text))
    assert whole == (
        "",
        "Checking.",
        [("get_weather", '{"city": "Paris", "days": 2}'), ("noop", "{}")],
    )
    for seed in range(30):
        assert summary(parse_in_pieces(plan, text, random.Random(seed))) == whole
    for bad in [
        '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
        "<tool_call>{not json</tool_call>",
        '<tool_call>\n{"name": "noop", "arguments": [1]}\n</tool_call>',
        "<tool_call>\nplain",
    ]:
        assert summary(plan.new().parse(bad)) == ("", bad, [])


@pytest.mark.parametrize(
    "value,schema,expected",
    [
        ("3", {"type": "integer"}, 3),
        ("2.5", {"type": "number"}, 2.5),
        ("false", {"type": "boolean"}, False),
        ('{"a": 1}', {"type": "object"}, {"a": 1}),
        ("[1]", {"type": "array"}, [1]),
        ("007", {"type": "string"}, "007"),
        ("three", {"type": "integer"}, "three"),
        ("null", {"type": ["integer", "null"]}, None),
        ("12", None, "12"),
        ("12", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 12),
        ("x", {"type": [{"bad": 1}]}, "x"),
        ("[[[[", {"type": "array"}, "[[[["),
    ],
)
def test_parameter_values_take_their_schema_types(
    value: str, schema: dict | None, expected: object
) -> None:
    assert convert_parameter(value, schema) == expected


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_random_garbage_never_raises(name: str) -> None:
    rng = random.Random(0)
    alphabet = [
        "<tool_call>",
        "</tool_call>",
        "<function=",
        "get_weather",
        "noop",
        ">",
        "<parameter=",
        "city",
        "</parameter>",
        "</function>",
        "<think>",
        "</think>",
        "{",
        "}",
        '"name"',
        ":",
        "\n",
        " ",
        "x",
        "<",
    ]
    schema_tools = (WEATHER, {"name": "noop", "parameters": {"properties": 5}})
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        plan = ParsingPlan(True, rng.random() < 0.5, name, schema_tools)
        whole = summary(plan.new().parse(text))
        assert summary(parse_in_pieces(plan, text, rng)) == whole
        for _, arguments in whole[2]:
            assert isinstance(json.loads(arguments), dict)


def test_flag_choices_match_the_parsers() -> None:
    assert set(FLAG_TOOL_CALL_PARSERS) == set(TOOL_CALL_PARSERS) and REASONING_PARSERS == ("qwen3",)
