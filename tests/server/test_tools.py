"""Tools and reasoning in /v1/chat/completions: tools rendered through the chat template, model text parsed into
``reasoning_content`` and ``tool_calls`` (non-streaming and streaming alike), bad tool choices refused with 400s.

Random weights never write a tool call, so the full parsing path runs on fabricated model text through the
response builder; the server tests check rendering, shapes and errors end to end with the official client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from sglang_lite.assets import TINY_MODEL_DIR
from sglang_lite.protocol.outputs import ReqOutput
from sglang_lite.server.openai_protocol import ChatCompletionRequest
from sglang_lite.server.openai_serving import Shape
from sglang_lite.server.openai_tools import parsing_plan, rendered_tools
from sglang_lite.server_args import ServerArgs
from tests.server.conftest import ServerProcess

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
MODEL_TEXT = (
    "The user wants weather.\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)
PARSERS = ServerArgs(tool_call_parser="qwen3_coder", reasoning_parser="qwen3")


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def chat_shape(body: dict, prompt: str = "<|im_start|>assistant\n<think>\n") -> Shape:
    request = ChatCompletionRequest(**body)
    return Shape("chat.completion", "m", parsing_plan(PARSERS, request, prompt))


def outputs(text: str, reason: str = "stop") -> list[ReqOutput]:
    """The text in three steps, the last with the finish reason."""
    cuts = [0, len(text) // 3, 2 * len(text) // 3, len(text)]
    return [
        ReqOutput(
            "r",
            [],
            text[a:b],
            b == len(text),
            {"finish_reason": {"type": reason}} if b == len(text) else {},
        )
        for a, b in zip(cuts, cuts[1:])
    ]


def whole(text: str, reason: str = "stop") -> ReqOutput:
    return ReqOutput("r", [], text, True, {"finish_reason": {"type": reason}})


# ---- the response builder on fabricated model text ------------------------------------------------------------------
def test_response_carries_reasoning_and_tool_calls() -> None:
    response = chat_shape({"messages": USER, "tools": [WEATHER]}).response(
        [
            ReqOutput(
                "r",
                [],
                MODEL_TEXT,
                True,
                {"finish_reason": {"type": "stop"}, "prompt_tokens": 5, "completion_tokens": 9},
            )
        ]
    )
    choice = response["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert (
        message["reasoning_content"] == "The user wants weather."
        and message["content"] == "Checking."
    )
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}


def test_stream_carries_the_same_as_the_response() -> None:
    shape = chat_shape({"messages": USER, "tools": [WEATHER], "stream": True})
    chunks = [
        c
        for i, out in enumerate(outputs(MODEL_TEXT))
        for c in shape.chunks(0, out, "stop" if out.finished else None, first=i == 0)
    ]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user wants weather."
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    pieces = [call for d in deltas for call in d.get("tool_calls", [])]
    assert pieces[0]["function"]["name"] == "get_weather" and pieces[0]["id"].startswith("call_")
    assert {p["index"] for p in pieces} == {0}
    assert json.loads("".join(p["function"]["arguments"] for p in pieces)) == {
        "city": "Paris",
        "days": 2,
    }
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_a_call_cut_by_max_tokens_keeps_length_and_no_call_without_tools() -> None:
    cut = MODEL_TEXT[: MODEL_TEXT.index("<parameter=days>")]
    choice = chat_shape({"messages": USER, "tools": [WEATHER]}).response([whole(cut, "length")])[
        "choices"
    ][0]
    assert (
        choice["finish_reason"] == "length"
        and choice["message"]["tool_calls"][0]["function"]["name"]
    )
    choice = chat_shape({"messages": USER}).response([whole(MODEL_TEXT)])["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"


def test_tool_choice_none_renders_and_parses_no_tools_and_a_named_one_renders_only_it() -> None:
    none = ChatCompletionRequest(messages=USER, tools=[WEATHER, CLOCK], tool_choice="none")
    assert rendered_tools(none) is None and parsing_plan(PARSERS, none, "").tool_parser is None
    named = ChatCompletionRequest(
        messages=USER,
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    assert [t["function"]["name"] for t in rendered_tools(named)] == ["get_time"]


def test_reasoning_is_off_without_thinking_or_separate_reasoning() -> None:
    for extra in (
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"separate_reasoning": False},
    ):
        message = chat_shape({"messages": USER, **extra}).response([whole("a</think>b")])[
            "choices"
        ][0]["message"]
        assert message == {"role": "assistant", "content": "a</think>b"}


# ---- the server -------------------------------------------------------------------------------------------------
def test_tools_are_rendered_into_the_prompt(tools_server: ServerProcess) -> None:
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR, local_files_only=True)
    text = tokenizer.apply_chat_template(
        USER, tools=[WEATHER], tokenize=False, add_generation_prompt=True
    )
    assert "get_weather" in text and "<function=example_function_name>" in text
    client = client_of(tools_server)
    plain = client.chat.completions.create(model="m", messages=USER, max_tokens=1)
    with_tools = client.chat.completions.create(
        model="m", messages=USER, tools=[WEATHER], max_tokens=1
    )
    assert with_tools.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
    none = client.chat.completions.create(
        model="m", messages=USER, tools=[WEATHER], tool_choice="none", max_tokens=1
    )
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens


def test_responses_are_valid_streaming_and_not(tools_server: ServerProcess) -> None:
    client = client_of(tools_server)
    kwargs = {"model": "m", "messages": USER, "tools": [WEATHER], "max_tokens": 8, "temperature": 0}
    result = client.chat.completions.create(**kwargs)
    message = result.choices[0].message
    assert result.choices[0].finish_reason in ("stop", "length", "tool_calls")
    reasoning = (message.model_extra or {}).get("reasoning_content")
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks
    )
    assert streamed == (reasoning or "")  # greedy: the same text, split the same way
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (message.content or "")
    assert chunks[-1].choices[0].finish_reason == result.choices[0].finish_reason


def test_thinking_off_leaves_everything_in_content(tools_server: ServerProcess) -> None:
    result = client_of(tools_server).chat.completions.create(
        model="m",
        messages=USER,
        max_tokens=8,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert (result.choices[0].message.model_extra or {}).get("reasoning_content") is None
    assert result.usage.completion_tokens == 8 and result.choices[0].message.content


def test_tool_history_renders(tools_server: ServerProcess) -> None:
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    result = client_of(tools_server).chat.completions.create(
        model="m", messages=messages, tools=[WEATHER], max_tokens=1
    )
    assert result.usage.prompt_tokens > 0


@pytest.mark.parametrize(
    "body,field",
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"description": "no name"}}]},
            "tools.0.function.name",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"type": "function", "function": {"name": "f", "arguments": "not json"}}
                        ],
                    }
                ]
            },
            "messages.0.tool_calls.0.function.arguments",
        ),
    ],
)
def test_bad_tools_are_400s_naming_the_field(
    tools_server: ServerProcess, body: dict, field: str
) -> None:
    response = httpx.post(
        f"{tools_server.url}/v1/chat/completions",
        timeout=30,
        json={"messages": USER, "max_tokens": 1, **body},
    )
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"]


LIGHT = {
    "type": "function",
    "function": {
        "name": "set_light",
        "parameters": {
            "type": "object",
            "properties": {"on": {"type": "boolean"}, "room": {"enum": ["kitchen", "hall"]}},
            "required": ["on", "room"],
            "additionalProperties": False,
        },
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "stop_alarm",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "set_light"}}],
    ids=["required", "named"],
)
def test_required_and_named_tool_choices_force_calls_even_from_random_weights(
    tools_server: ServerProcess, choice
) -> None:
    """The output is constrained to a JSON list of the allowed calls, which becomes ``tool_calls``. (Closed
    parameter schemas: random weights would babble inside free strings until max_tokens. Thinking off: with it on,
    the list would follow a </think> that random weights never write; tests/server/test_reasoning_structured.py.)"""
    args = dict(
        model="m",
        messages=USER,
        tools=[LIGHT, ALARM],
        tool_choice=choice,
        max_tokens=200,
        temperature=1.0,
        seed=5,
        parallel_tool_calls=False,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    names = {"set_light"} if isinstance(choice, dict) else {"set_light", "stop_alarm"}
    response = client_of(tools_server).chat.completions.create(**args)
    choice_out = response.choices[0]
    assert choice_out.finish_reason == "tool_calls", choice_out
    (call,) = choice_out.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name in names
    assert (
        arguments == {}
        if call.function.name == "stop_alarm"
        else arguments["room"] in ("kitchen", "hall")
    )
    streamed = [
        c
        for chunk in client_of(tools_server).chat.completions.create(**args, stream=True)
        for c in chunk.choices
    ]
    calls = [tc for c in streamed if c.delta.tool_calls for tc in c.delta.tool_calls]
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (call.function.name, call.function.arguments)
    ]
    assert streamed[-1].finish_reason == "tool_calls"


def test_shape_builds_tool_calls_from_a_forced_list() -> None:
    shape = Shape("chat.completion", "m", forced_tools=True)
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    choice = shape.response([whole(text)])["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == [
        "get_weather",
        "get_time",
    ]
    cut = shape.response([whole(text[:20], "length")])["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"] == text[:20]
