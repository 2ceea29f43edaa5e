"""Tools and reasoning in chat completions, as SGLang serves them: which tools the template renders, how the output
is parsed (``--reasoning-parser``, ``--tool-call-parser``), and the OpenAI shapes of what the parsers found.

- ``tool_choice`` defaults to ``auto`` with tools and ``none`` without. ``none``: no tool is rendered and nothing
  is parsed as a call. ``auto`` / ``required``: every tool is rendered; a named function: only that one.
- ``required`` and a named function constrain the output, as SGLang does, with a JSON schema (xgrammar): a list of
  ``{"name", "parameters"}`` calls of the allowed functions (one at most without ``parallel_tool_calls``), which
  becomes ``tool_calls`` whatever parser is configured. Each function's ``parameters`` schema moves into the list
  schema's ``$defs`` (as ``tool<i>``, ``i`` its place in ``tools``, so two tools' ``$defs`` never clash) with its
  local references (``#``, ``#/$defs/X`` as pydantic writes them) made to point there: they resolve as they do in
  ``response_format``.
- Tools without ``--tool-call-parser`` are rendered but not parsed (calls stay in ``content``), as in SGLang.
- Reasoning is parsed with ``--reasoning-parser``, ``separate_reasoning`` (default true) and thinking on (not
  ``chat_template_kwargs.enable_thinking: false``); it starts inside reasoning when the prompt ends in an open
  ``<think>`` block (Qwen3.5's template with thinking on).
- With a reasoning parser and thinking on, a grammar (``response_format``, ``regex``, ``ebnf``, a forced tool call)
  constrains only the answer after ``</think>`` (``require_reasoning``), so ``content`` holds the JSON and
  ``reasoning_content`` the free reasoning before it. Output cut by ``max_tokens`` before ``</think>`` was never
  constrained: it is all ``reasoning_content``, ``content`` is empty and ``finish_reason`` is ``length``.
- ``finish_reason`` is ``tool_calls`` when calls were parsed and the model stopped by itself (``length`` stays).
"""

from __future__ import annotations

import json
from typing import Any

from sglang_lite.sampling.grammar_compile import MAX_JSON_DEPTH
from sglang_lite.server.io_struct import bad_request
from sglang_lite.server.openai_protocol import ChatCompletionRequest
from sglang_lite.server.parsers import (
    OutputParser,
    ParsedText,
    ParsingPlan,
    join_tool_calls,
    prompt_opens_reasoning,
)
from sglang_lite.server.parsers.base import new_call_id
from sglang_lite.server_args import ServerArgs


def check_tools(body: ChatCompletionRequest) -> None:
    """A 400 naming the field for tool choices the tools cannot satisfy and for ambiguous tools."""
    names = [tool.function.name for tool in body.tools or []]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique")
    choice = body.tool_choice
    if choice == "required" and not names:
        raise bad_request("tool_choice: 'required' needs tools")
    if choice is not None and not isinstance(choice, str) and choice.function.name not in names:
        raise bad_request(f"tool_choice: function {choice.function.name!r} is not in tools")


def tool_choice(body: ChatCompletionRequest) -> Any:
    return body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")


def rendered_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tool definitions the chat template renders (None: none)."""
    choice = tool_choice(body)
    if choice == "none":
        return None
    named = None if isinstance(choice, str) else choice.function.name
    tools = [
        t.model_dump(exclude_none=True)
        for t in body.tools or []
        if named in (None, t.function.name)
    ]
    return tools or None


def requires_reasoning(args: ServerArgs, body: ChatCompletionRequest) -> bool:
    """Whether the output starts inside its reasoning, so that a grammar (``response_format``, ``regex``,
    ``ebnf``, a forced tool call) constrains only the answer after it: with a reasoning parser and thinking on
    (SGLang's ``require_reasoning`` for its qwen3 parser)."""
    thinking = (body.chat_template_kwargs or {}).get("enable_thinking", True) is not False
    return args.reasoning_parser is not None and thinking


def parsing_plan(
    args: ServerArgs, body: ChatCompletionRequest, prompt: str, forced: bool = False
) -> ParsingPlan | None:
    """``forced``: the output is a forced tool call's JSON (``tool_call_schema``), so only reasoning is parsed."""
    reasoning = requires_reasoning(args, body) and body.separate_reasoning
    tools = rendered_tools(body) if args.tool_call_parser and not forced else None
    plan = ParsingPlan(
        reasoning=reasoning,
        starts_in_reasoning=reasoning and prompt_opens_reasoning(prompt),
        tool_parser=args.tool_call_parser if tools else None,
        tools=tuple(t["function"] for t in tools or ()),
    )
    return plan if plan.active else None


def tool_call_schema(body: ChatCompletionRequest) -> str | None:
    """The JSON schema that forces tool calls (``required`` or a named function), or None."""
    choice = tool_choice(body)
    if choice in ("none", "auto"):
        return None
    # by their place in ``tools``, which names their parameters schema in ``$defs`` and in errors
    positions = {t.function.name: i for i, t in enumerate(body.tools or [])}
    functions = {positions[t["function"]["name"]]: t["function"] for t in rendered_tools(body)}
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [function["name"]]},
                "parameters": {"$ref": f"#/$defs/tool{i}"},
            },
            "required": ["name", "parameters"],
        }
        for i, function in functions.items()
    ]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
    schema["$defs"] = {
        f"tool{i}": _moved_parameters(i, function) for i, function in functions.items()
    }
    if not body.parallel_tool_calls or not isinstance(choice, str):
        schema["maxItems"] = 1
    return json.dumps(schema)


# keywords whose values are data, not schemas: a "$ref" in them is a value
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# keywords whose values map names (any names, "enum" and "default" included) to schemas
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def _moved_parameters(index: int, function: dict[str, Any]) -> Any:
    """The parameters schema of ``tools[index]`` as ``#/$defs/tool<index>`` of the tool-call schema."""
    try:
        return moved_schema(function.get("parameters") or {"type": "object"}, f"/$defs/tool{index}")
    except ValueError as error:
        raise bad_request(f"tools.{index}.function.parameters {error}") from None


def moved_schema(schema: Any, base: str, depth: int = 1) -> Any:
    """``schema`` moved to the JSON pointer ``base`` of a larger schema: its local references (``#`` and ``#/...``)
    point below ``base``; other references, and data (``const``, ``enum``, ...), are left as they are. A schema
    nested deeper than ``MAX_JSON_DEPTH`` (which no grammar compiles) is a ValueError."""
    if not isinstance(schema, dict):
        return schema
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"nests more than {MAX_JSON_DEPTH} levels deep")
    return {key: _moved_value(key, value, base, depth + 1) for key, value in schema.items()}


def _moved_value(key: str, value: Any, base: str, depth: int) -> Any:
    if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
        return "#" + base + value[1:]
    if key in _DATA_KEYWORDS:
        return value
    if key in _SCHEMA_MAPS and isinstance(value, dict):
        return {name: moved_schema(sub, base, depth + 1) for name, sub in value.items()}
    if isinstance(value, list):  # allOf, anyOf, oneOf, prefixItems, ...
        return [moved_schema(item, base, depth + 1) for item in value]
    return moved_schema(value, base, depth)


def forced_tool_message(text: str) -> dict[str, Any]:
    """The ``message`` of an output the tool-call schema constrained: its calls (the text when it is cut short)."""
    try:
        calls = json.loads(text)
    except ValueError:  # max_tokens ran out inside the list
        return {"role": "assistant", "content": text}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": new_call_id(),
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": json.dumps(call["parameters"], ensure_ascii=False),
                },
            }
            for call in calls
        ],
    }


def tool_finish_reason(parser: OutputParser, reason: str | None) -> str | None:
    return "tool_calls" if reason == "stop" and parser.saw_tool_calls else reason


def parsed_message(parser: OutputParser, text: str) -> dict[str, Any]:
    """The non-streaming ``message`` of a whole output."""
    parsed = parser.parse(text)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parser.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning or None
    calls = join_tool_calls(parsed.tool_calls)
    if calls:
        message["content"] = parsed.content or None
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return message


def parsed_deltas(parsed: ParsedText, first: bool) -> list[dict[str, Any]]:
    """The streaming ``delta``s of one step: reasoning and text together, then one per tool-call piece."""
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    if parsed.reasoning:
        delta["reasoning_content"] = parsed.reasoning
    if parsed.content or first:
        delta["content"] = parsed.content
    deltas = [delta] if delta else []
    for piece in parsed.tool_calls:
        call: dict[str, Any] = {"index": piece.index, "function": {"arguments": piece.arguments}}
        if piece.name is not None:
            call.update(id=piece.id, type="function")
            call["function"]["name"] = piece.name
        deltas.append({"tool_calls": [call]})
    return deltas
