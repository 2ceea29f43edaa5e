"""Reasoning plus structured output, as upstream SGLang serves it: with ``--reasoning-parser`` and thinking on, a
grammar (``response_format``, ``regex``, ``ebnf``, a forced tool call) constrains only the answer after
``</think>``, so ``content`` holds the JSON and ``reasoning_content`` the free reasoning before it.

Random weights never write ``</think>``, so the answer's path runs on fabricated model text through the response
builder (and on crafted logits in tests/engine/test_grammar_reasoning.py); the server tests check what a client
sees end to end: the reasoning is not constrained (the same tokens as without a grammar, streaming or not, with
n > 1) and ends with ``length``, thinking off constrains at once, /generate takes ``require_reasoning``."""

from __future__ import annotations

import json

import httpx
import pytest

from sglang_lite.protocol.outputs import ReqOutput
from sglang_lite.server.openai_protocol import ChatCompletionRequest
from sglang_lite.server.openai_serving import Shape
from sglang_lite.server.openai_tools import parsing_plan, tool_call_schema
from sglang_lite.server_args import ServerArgs
from tests.server.conftest import ServerProcess

PARSERS = ServerArgs(tool_call_parser="qwen3_coder", reasoning_parser="qwen3")
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
    "required": ["ok", "color"],
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
CHAT = [{"role": "user", "content": "Answer in JSON."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
OPEN_THINK = "<|im_start|>assistant\n<think>\n"


def shape_of(body: dict) -> Shape:
    request = ChatCompletionRequest(**body)
    forced = tool_call_schema(request) is not None
    plan = parsing_plan(PARSERS, request, OPEN_THINK, forced=forced)
    return Shape("chat.completion", "m", plan, forced_tools=forced)


def pieces(text: str) -> list[ReqOutput]:
    """The text one character a step (tags split across steps), the last with finish reason stop."""
    return [
        ReqOutput("r", [], c, i == len(text) - 1, {"finish_reason": {"type": "stop"}})
        for i, c in enumerate(text)
    ]


def streamed(shape: Shape, text: str) -> list[dict]:
    outs = pieces(text)
    chunks = [
        c
        for i, out in enumerate(outs)
        for c in shape.chunks(0, out, "stop" if out.finished else None, first=i == 0)
    ]
    return [c["choices"][0] for c in chunks]


# ---- the response builder on fabricated model text ---------------------------------------------------------------
def test_the_json_answer_after_the_reasoning_is_the_content() -> None:
    text = 'Red, I think.\n</think>\n\n{"ok": true, "color": "red"}'
    shape = shape_of({"messages": CHAT, "response_format": FORMAT})
    message = shape.response([ReqOutput("r", [], text, True, {})])["choices"][0]["message"]
    assert message["reasoning_content"] == "Red, I think."
    assert json.loads(message["content"]) == {"ok": True, "color": "red"}
    choices = streamed(shape_of({"messages": CHAT, "response_format": FORMAT}), text)
    assert "".join(c["delta"].get("reasoning_content", "") for c in choices) == "Red, I think."
    assert "".join(c["delta"].get("content") or "" for c in choices) == message["content"]


def test_a_forced_tool_call_after_the_reasoning_becomes_tool_calls() -> None:
    body = {"messages": CHAT, "tools": [WEATHER], "tool_choice": "required"}
    text = 'Paris.</think>\n\n[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    stop = {"finish_reason": {"type": "stop"}}
    choice = shape_of(body).response([ReqOutput("r", [], text, True, stop)])["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["reasoning_content"] == "Paris."
    (call,) = message["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    choices = streamed(shape_of(body), text)
    assert "".join(c["delta"].get("reasoning_content", "") for c in choices) == "Paris."
    (last,) = [c for c in choices if "tool_calls" in c["delta"]]
    assert last["finish_reason"] == "tool_calls"
    assert json.loads(last["delta"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


def test_a_forced_tool_call_cut_in_its_reasoning_is_all_reasoning() -> None:
    body = {"messages": CHAT, "tools": [WEATHER], "tool_choice": "required"}
    outputs = [ReqOutput("r", [], "still thinking", True, {"finish_reason": {"type": "length"}})]
    choice = shape_of(body).response(outputs)["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["reasoning_content"] == "still thinking"
    assert "tool_calls" not in choice["message"] and not choice["message"]["content"]


# ---- a server with the Qwen3.5 parsers ---------------------------------------------------------------------------
def chat(server: ServerProcess, **body) -> httpx.Response:
    body = {"model": "m", "messages": CHAT, "max_tokens": 16, "temperature": 0, **body}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


def chat_stream(server: ServerProcess, **body) -> dict[int, dict]:
    """Each choice's reasoning, content and finish reason, joined from the stream."""
    body = {"model": "m", "messages": CHAT, "max_tokens": 16, "temperature": 0, **body}
    choices: dict[int, dict] = {}
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                joined = choices.setdefault(
                    choice["index"], {"reasoning": "", "content": "", "finish": None}
                )
                joined["reasoning"] += choice["delta"].get("reasoning_content") or ""
                joined["content"] += choice["delta"].get("content") or ""
                joined["finish"] = choice["finish_reason"] or joined["finish"]
    return choices


@pytest.mark.parametrize(
    "grammar,free",
    [
        ({"response_format": FORMAT}, {}),
        ({"response_format": {"type": "json_object"}}, {}),
        ({"regex": "[0-9]{4}"}, {}),
        ({"ebnf": 'root ::= "yes" | "no"'}, {}),
        # the template renders the same tools for auto
        ({"tools": [WEATHER], "tool_choice": "required"}, {"tools": [WEATHER]}),
    ],
    ids=["json_schema", "json_object", "regex", "ebnf", "forced_tool"],
)
def test_the_reasoning_is_not_constrained_and_is_cut_by_max_tokens(
    tools_server: ServerProcess, grammar: dict, free: dict
) -> None:
    """Random weights never close the think block within 16 tokens: every choice, streamed or not, is the free
    text of the same request without a grammar, all in reasoning_content, with finish reason length."""
    plain = chat(tools_server, n=2, **free).json()["choices"]
    reasonings = [c["message"]["reasoning_content"] for c in plain]
    assert all(reasonings) and all(c["finish_reason"] == "length" for c in plain)
    constrained = chat(tools_server, n=2, **grammar)
    assert constrained.status_code == 200, constrained.text
    for choice, reasoning in zip(constrained.json()["choices"], reasonings):
        message = choice["message"]
        assert message["reasoning_content"] == reasoning and not message["content"]
        assert choice["finish_reason"] == "length" and "tool_calls" not in message
    for joined, reasoning in zip(chat_stream(tools_server, n=2, **grammar).values(), reasonings):
        assert joined == {"reasoning": reasoning, "content": "", "finish": "length"}


def test_with_thinking_off_the_grammar_constrains_the_whole_answer(
    tools_server: ServerProcess,
) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    for seed in range(2):
        body = {**off, "response_format": FORMAT, "max_tokens": 60, "temperature": 1, "seed": seed}
        choice = chat(tools_server, **body).json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert choice["message"].get("reasoning_content") is None
        assert set(json.loads(choice["message"]["content"])) == {"ok", "color"}
        joined = chat_stream(tools_server, **body)[0]
        assert joined["content"] == choice["message"]["content"] and not joined["reasoning"]


def generate(server: ServerProcess, **body) -> httpx.Response:
    body = {"text": "<|im_start|>assistant\n<think>\n", **body}
    return httpx.post(f"{server.url}/generate", json=body, timeout=120)


def test_generate_takes_require_reasoning(tools_server: ServerProcess) -> None:
    free = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = generate(tools_server, sampling_params=free).json()
    reasoning = generate(
        tools_server, sampling_params={**free, "regex": "[0-9]{2}"}, require_reasoning=True
    ).json()
    assert reasoning["output_ids"] == plain["output_ids"]
    assert reasoning["meta_info"]["finish_reason"]["type"] == "length"
    in_params = {**free, "regex": "[0-9]{2}", "require_reasoning": True}
    assert generate(tools_server, sampling_params=in_params).json()["text"] == plain["text"]
    digits = generate(tools_server, sampling_params={**free, "regex": "[0-9]{2}"}).json()
    assert len(digits["text"]) == 2 and digits["text"].isdigit()


def test_require_reasoning_without_a_reasoning_parser_is_a_400(server_dp1: ServerProcess) -> None:
    for body in (
        {"require_reasoning": True},
        {"sampling_params": {"require_reasoning": True}},
        {"require_reasoning": "yes"},
    ):
        response = generate(server_dp1, **body)
        assert response.status_code == 400 and "require_reasoning" in response.text, response.text
