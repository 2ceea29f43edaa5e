"""The hostile battery's grammars (JSON schemas, regexes, EBNF, structural tags, reasoning), chat templates and
tool definitions."""

from __future__ import annotations

import json

from tests.tools.hostile import ANSWERED, EITHER, Case
from tests.tools.hostile_checks import chat_ok, native_ok
from tests.tools.hostile_requests import (
    CHAT,
    HUGE_TEXT,
    WEATHER,
    chat,
    completion,
    gen,
    wide_schema,
)

# compiles in well under a second, then each token mask takes longer (seconds within a few tokens): refused by
# the checker's or the rank's mask budget (--grammar-mask-budget-ms), or right if every mask stays within it
GROWING_REGEX = "(.*){1,32000}[bc]"


def grammar_cases() -> list[Case]:
    recursive = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    deep = json.loads('{"type": "array", "items": ' * 200 + "{}" + "}" * 200)
    return [
        Case("a regex with no first token", "/generate", gen({"regex": "[^\\s\\S]"})),
        Case("a regex that cannot finish", "/generate", gen({"regex": "a[^\\s\\S]"})),
        Case("EBNF that only recurses (left)", "/generate", gen({"ebnf": 'root ::= root "a"'})),
        Case("EBNF that never finishes", "/v1/completions", completion(ebnf='root ::= "a" root')),
        Case("EBNF that does not parse", "/generate", gen({"ebnf": "root ::= (("})),
        Case(
            "EBNF nested 2000 deep",
            "/generate",
            gen({"ebnf": "root ::= " + "(" * 2000 + '"a"' + ")" * 2000}),
        ),
        Case(
            "a schema that requires itself",
            "/v1/chat/completions",
            chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "r", "schema": recursive},
                }
            ),
        ),
        Case(
            "a schema with a dangling $ref",
            "/generate",
            gen({"json_schema": json.dumps({"$ref": "#/$defs/missing"})}),
        ),
        Case("a schema that is a list", "/generate", gen({"json_schema": "[1, 2]"})),
        Case(
            "a schema nested 200 deep",
            "/v1/chat/completions",
            chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "d", "schema": deep},
                }
            ),
        ),
        Case(
            "a 64 KB schema that compiles for minutes",
            "/generate",
            gen({"json_schema": wide_schema()}),
        ),
        Case("two grammars at once", "/generate", gen({"regex": "a", "ebnf": 'root ::= "a"'})),
        Case("a regex over 64K characters", "/generate", gen({"regex": "a" * 70_000})),
        Case("a regex backreference", "/generate", gen({"regex": "(a)\\1"})),
        Case(
            "a catastrophic-backtracking regex",
            "/generate",
            gen({"regex": "(a+)+$", "max_new_tokens": 6}),
            ANSWERED,
            check=native_ok(pattern="a*"),
        ),
        Case(
            "a regex whose masks grow with every token",
            "/generate",
            gen({"regex": GROWING_REGEX, "max_new_tokens": 6}),
            EITHER,
            check=native_ok(pattern="(?s).*[bc]"),
        ),
        Case(
            "a regex whose masks grow, in a chat",
            "/v1/chat/completions",
            chat(
                regex=GROWING_REGEX,
                max_tokens=6,
                chat_template_kwargs={"enable_thinking": False},
            ),
            EITHER,
            check=chat_ok(),
        ),
        Case(
            "a self-referencing schema (optional)",
            "/generate",
            gen(
                {
                    "json_schema": json.dumps(
                        {"type": "object", "properties": {"a": {"$ref": "#"}}}
                    ),
                    "max_new_tokens": 8,
                }
            ),
            ANSWERED,
            check=native_ok(json_prefix=True),
        ),
        Case(
            "a structural tag without a format",
            "/v1/chat/completions",
            chat(response_format={"type": "structural_tag"}),
        ),
        Case(
            "a structural tag of an unknown type",
            "/generate",
            gen(
                {
                    "structural_tag": json.dumps(
                        {"type": "structural_tag", "format": {"type": "nope"}}
                    )
                }
            ),
        ),
        Case(
            "response_format yaml", "/v1/chat/completions", chat(response_format={"type": "yaml"})
        ),
        Case(
            "json_object with thinking on",
            "/v1/chat/completions",
            chat(response_format={"type": "json_object"}, n=2),
            ANSWERED,
            check=chat_ok(n=2),
        ),
        Case(
            "json_schema with thinking off",
            "/v1/chat/completions",
            chat(
                max_tokens=40,
                chat_template_kwargs={"enable_thinking": False},
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "b", "schema": {"type": "boolean"}},
                },
            ),
            ANSWERED,
            check=chat_ok(json_content=True),
        ),
        Case("require_reasoning as text", "/generate", gen(require_reasoning="yes")),
    ]


def template_and_tool_cases() -> list[Case]:
    return [
        Case(
            "a client chat template",
            "/v1/chat/completions",
            chat(
                chat_template_kwargs={"chat_template": "{% for i in range(10**9) %}x{% endfor %}"}
            ),
        ),
        Case(
            "tokenize in template kwargs",
            "/v1/chat/completions",
            chat(chat_template_kwargs={"tokenize": True}),
        ),
        Case(
            "template kwargs not an object", "/v1/chat/completions", chat(chat_template_kwargs=[1])
        ),
        Case(
            "an unknown template variable",
            "/v1/chat/completions",
            chat(chat_template_kwargs={"enable_thinking": "maybe", "x": "y" * 10_000}),
            ANSWERED,
            check=chat_ok(),
        ),
        Case(
            "Jinja in the content",
            "/v1/chat/completions",
            chat(
                messages=[
                    {
                        "role": "user",
                        "content": "{{ 7*7 }}{% for x in range(9**9) %}{% endfor %}{{ raise('x') }}",
                    }
                ]
            ),
            ANSWERED,
            check=chat_ok(),
        ),
        Case("10k messages", "/v1/chat/completions", chat(messages=CHAT * 10_000)),
        Case(
            "huge reasoning_content",
            "/v1/chat/completions",
            chat(messages=[{"role": "assistant", "content": "x", "reasoning_content": HUGE_TEXT}]),
        ),
        Case(
            "tool arguments that are not JSON",
            "/v1/chat/completions",
            chat(
                messages=[
                    *CHAT,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"type": "function", "function": {"name": "f", "arguments": "{oops"}}
                        ],
                    },
                ]
            ),
        ),
        Case("duplicate tool names", "/v1/chat/completions", chat(tools=[WEATHER, WEATHER])),
        Case(
            "a tool without a name",
            "/v1/chat/completions",
            chat(tools=[{"type": "function", "function": {"description": "x"}}]),
        ),
        Case(
            "tool parameters as text",
            "/v1/chat/completions",
            chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
        ),
        Case(
            "a named tool choice that is missing",
            "/v1/chat/completions",
            chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
        ),
        Case(
            "required tool choice with a cyclic schema",
            "/v1/chat/completions",
            chat(
                tools=[
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"x": {"$ref": "#/properties/parameters"}},
                                "required": ["x"],
                            },
                        },
                    }
                ],
                tool_choice="required",
            ),
        ),
        Case(
            "2000 tools",
            "/v1/chat/completions",
            chat(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(2000)]),
        ),
        Case(
            "a forced tool call",
            "/v1/chat/completions",
            chat(tools=[WEATHER], tool_choice="required", max_tokens=8),
            ANSWERED,
            check=chat_ok(),
        ),
    ]
