"""Structured output over HTTP: OpenAI ``response_format`` (json_object, json_schema), the native ``regex`` and
``ebnf``, and a grammar that cannot compile refused with a 400 naming its field (random weights: the outputs must
still parse and match)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from sglang_lite.server.openai_protocol import ChatCompletionRequest
from tests.server.conftest import ServerProcess

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
    "required": ["ok", "color"],
}
CHAT = [{"role": "user", "content": "Answer in JSON."}]
REGEX = r"(yes|no), [0-9]{1,3}!"


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


@pytest.mark.parametrize(
    "response_format,grammar",
    [
        ({"type": "text"}, {}),
        ({"type": "json_object"}, {"json_schema": '{"type": "object"}'}),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
            },
            {"json_schema": json.dumps(SCHEMA)},
        ),
    ],
)
def test_response_format_becomes_sglang_sampling_parameters(response_format, grammar):
    body = ChatCompletionRequest.model_validate(
        {"messages": CHAT, "response_format": response_format}
    )
    sampling = body.sampling_dict(None)
    assert {k: sampling[k] for k in ("json_schema", "regex", "ebnf") if sampling.get(k)} == grammar


def test_chat_json_schema_output_parses_and_matches(server_dp1: ServerProcess) -> None:
    format_ = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    for seed in range(3):
        body = {
            "messages": CHAT,
            "response_format": format_,
            "max_tokens": 60,
            "temperature": 1.0,
            "seed": seed,
        }
        response = post(server_dp1, "/v1/chat/completions", body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        value = json.loads(choice["message"]["content"])
        assert choice["finish_reason"] == "stop" and set(value) == {"ok", "color"}
        assert isinstance(value["ok"], bool) and value["color"] in ("red", "green")


def test_chat_json_object_outputs_are_objects(server_dp1: ServerProcess) -> None:
    """Keys are free strings, where random weights may babble on: the outputs that end are objects."""
    ended = []
    for seed in range(6):
        body = {
            "messages": CHAT,
            "response_format": {"type": "json_object"},
            "max_tokens": 30,
            "seed": seed,
        }
        response = post(server_dp1, "/v1/chat/completions", body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["message"]["content"].startswith("{")
        if choice["finish_reason"] == "stop":
            ended.append(json.loads(choice["message"]["content"]))
    assert ended and all(isinstance(value, dict) for value in ended)


def test_native_regex_and_ebnf_outputs_match(server_dp1: ServerProcess) -> None:
    ebnf = 'root ::= "x = " [0-9] [0-9]? ";"'
    params = [
        {"regex": REGEX, "max_new_tokens": 40, "temperature": 1.0, "seed": 1},
        {"ebnf": ebnf, "max_new_tokens": 40, "temperature": 0.0},
    ]
    response = post(
        server_dp1, "/generate", {"text": ["def f():\n", "import os\n"], "sampling_params": params}
    )
    assert response.status_code == 200, response.text
    regex_out, ebnf_out = response.json()
    assert re.fullmatch(REGEX, regex_out["text"]), regex_out["text"]
    assert re.fullmatch(r"x = [0-9]{1,2};", ebnf_out["text"]), ebnf_out["text"]


def test_streamed_regex_output_matches(server_dp1: ServerProcess) -> None:
    body = {
        "model": "m",
        "prompt": "hi",
        "regex": REGEX,
        "max_tokens": 40,
        "stream": True,
        "seed": 2,
    }
    with httpx.stream(
        "POST", f"{server_dp1.url}/v1/completions", json=body, timeout=120
    ) as response:
        assert response.status_code == 200
        lines = [
            line[6:]
            for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    text = "".join(c["choices"][0]["text"] for c in map(json.loads, lines) if c.get("choices"))
    assert re.fullmatch(REGEX, text), text


@pytest.mark.parametrize(
    "path,body,needle",
    [
        (
            "/generate",
            {"text": "hi", "sampling_params": {"regex": "(ab"}},
            "sampling parameter regex does not compile",
        ),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"ebnf": "root ::= nothing"}},
            "sampling parameter ebnf does not compile",
        ),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"regex": "a", "json_schema": "{}"}},
            "at most one",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": CHAT,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "bad", "schema": {"type": "object", "properties": 3}},
                },
            },
            "sampling parameter json_schema does not",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "response_format": {"type": "json_schema"}},
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "response_format": {"type": "yaml"}},
            "response_format",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "regex": "[0-9"},
            "sampling parameter regex does not compile",
        ),
        # grammars whose language is empty: refused when compiled, never met in sampling
        (
            "/generate",
            {"text": "hi", "sampling_params": {"ebnf": 'root ::= root "a"'}},
            "sampling parameter ebnf admits no output",
        ),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"regex": "[^\\s\\S]", "temperature": 1.0}},
            "sampling parameter regex admits no output",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "ebnf": 'root ::= root "a"', "stream": True},
            "sampling parameter ebnf admits no output",
        ),
    ],
)
def test_a_grammar_that_cannot_compile_is_a_400_naming_its_field(
    server_dp1: ServerProcess, path: str, body: dict, needle: str
) -> None:
    response = post(server_dp1, path, body)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert needle in message and ".cc:" not in message, message


TAG_FORMAT = {
    "type": "tag",
    "begin": "<n>",
    "content": {"type": "regex", "pattern": "[0-9]{2}"},
    "end": "</n>",
}


def test_a_structural_tag_response_format_constrains_the_output(server_dp1: ServerProcess) -> None:
    body = {
        "messages": CHAT,
        "response_format": {"type": "structural_tag", "format": TAG_FORMAT},
        "max_tokens": 20,
        "temperature": 1.0,
        "seed": 3,
    }
    choice = post(server_dp1, "/v1/chat/completions", body).json()["choices"][0]
    assert re.fullmatch(r"<n>[0-9]{2}</n>", choice["message"]["content"]), choice
    legacy = {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
        "triggers": ["<f"],
    }
    response = post(server_dp1, "/v1/chat/completions", {**body, "response_format": legacy})
    assert response.status_code == 200, response.text
    native = {"text": "hi", "sampling_params": {"structural_tag": json.dumps(legacy)}}
    assert post(server_dp1, "/generate", {**native, "max_new_tokens": 4}).status_code == 200


@pytest.mark.parametrize(
    "response_format,needle",
    [
        ({"type": "structural_tag"}, "structures and triggers, or format"),
        ({"type": "structural_tag", "format": {"type": "nope"}}, "structural_tag does not compile"),
        (
            {"type": "structural_tag", "structures": [{"begin": "<f>"}], "triggers": ["<f"]},
            "schema",
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "deep", "schema": {"items": [[[[]]]] * 1}},
            },
            "does not compile",
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {
                    "name": "deep",
                    "schema": json.loads('{"type": "array", "items": ' * 80 + "{}" + "}" * 80),
                },
            },
            "nests 81 levels deep, more than 64",
        ),
    ],
)
def test_a_bad_structural_tag_or_deep_schema_is_a_400(
    server_dp1: ServerProcess, response_format: dict, needle: str
) -> None:
    body = {"messages": CHAT, "response_format": response_format, "max_tokens": 4}
    response = post(server_dp1, "/v1/chat/completions", body)
    assert response.status_code == 400 and needle in response.json()["error"]["message"], (
        response.text
    )
