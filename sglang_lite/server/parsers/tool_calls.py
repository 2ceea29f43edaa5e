"""Tool-call parsers: ``<tool_call>`` blocks in the answer become OpenAI ``tool_calls`` (``--tool-call-parser``).

Both formats SGLang serves Qwen with wrap each call in ``<tool_call>``...``</tool_call>``:

- ``qwen3_coder`` (Qwen3.5, Qwen3-Coder; what Qwen3.5's chat template asks for)::

      <tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>

  A value is text; it is converted by the type the tool's JSON schema gives the parameter (a string stays a
  string, other types are parsed as JSON when they parse). The call is committed, and its name streamed, once
  ``<function=NAME>`` names one of the request's tools; its arguments follow when the block ends.
- ``qwen25`` (Qwen2.5, Qwen3 dense)::

      <tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>

  decided when the block ends (or the output does).

Anything else stays answer text: a block that names no tool of the request, JSON that does not parse,
``<tool_call>`` followed by something else. Whitespace around
calls is dropped (the template puts a blank line before a call); the rest of the answer passes through as it
comes, except a possible start of ``<tool_call>`` at the end of a delta, held until it is decided.
"""

from __future__ import annotations

import json
import re
from typing import Any

from sglang_lite.server.parsers.base import ParsedText, ToolCallDelta, new_call_id, partial_suffix

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
MAX_LEADING_SPACE = 64  # whitespace allowed between <tool_call> and the call itself
_WAIT, _REJECT = object(), object()  # what _open may answer besides a header
# a value ends at </parameter>, or where the model went on without it; one still open at the end is dropped
_PARAMETER = re.compile(
    r"<parameter=([^>\n]{1,256})>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>))", re.DOTALL
)


class ToolCallParser:
    """The block scanner both formats share; a format says when a block opens and what a closed block holds."""

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.tools = {tool["name"]: _as_dict(tool.get("parameters")) for tool in tools}
        self.calls = 0
        self._buffer = ""  # undecided text; while a block is pending it starts with <tool_call>
        self._block: Any = None  # the pending block's header (format-specific), None outside blocks
        self._searched = 0  # how far the pending block was searched for </tool_call>
        self._pending_space = ""  # the answer's trailing whitespace, dropped if a call follows
        self._after_call = False  # the answer's whitespace right after a call is dropped

    def feed(self, text: str) -> ParsedText:
        self._buffer += text
        return self._scan(final=False)

    def finish(self) -> ParsedText:
        out = self._scan(final=True)
        out.content += self._pending_space
        self._pending_space = ""
        return out

    # ---- the formats ---------------------------------------------------------------------------------------------
    def _open(self, rest: str, final: bool) -> Any:
        """Given the text after <tool_call>: _WAIT, _REJECT, or the block's header (truthy)."""
        raise NotImplementedError

    def _close(self, header: Any, body: str) -> tuple[str | None, dict[str, Any]] | None:
        """A finished block's (name, arguments); a name of None when the name was already streamed. None: not a
        call after all (the block is answer text)."""
        raise NotImplementedError

    def _header_deltas(self, header: Any) -> list[ToolCallDelta]:
        """What a format streams when a block opens: nothing, or a committed call's id and name."""
        return []

    # ---- the scanner -----------------------------------------------------------------------------------------------
    def _scan(self, final: bool) -> ParsedText:
        out = ParsedText()
        while self._buffer:
            if self._block is None:
                if not self._start_block(out, final):
                    break
            elif not self._end_block(out, final):
                break
        return out

    def _start_block(self, out: ParsedText, final: bool) -> bool:
        start = self._buffer.find(CALL_START)
        if start == -1:
            keep = 0 if final else partial_suffix(self._buffer, CALL_START)
            self._answer(out, self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        self._answer(out, self._buffer[:start])
        self._buffer = self._buffer[start:]
        header = self._open(self._buffer[len(CALL_START) :], final)
        if header is _WAIT:
            return False
        if header is _REJECT:
            self._reject(out)
            return True
        self._block, self._searched = header, len(CALL_START)
        deltas = self._header_deltas(header)
        if deltas:
            self._commit(out, deltas)
        return True

    def _end_block(self, out: ParsedText, final: bool) -> bool:
        end = self._buffer.find(CALL_END, max(len(CALL_START), self._searched - len(CALL_END)))
        if end == -1 and not final:
            self._searched = len(self._buffer)
            return False
        stop = end if end != -1 else len(self._buffer)
        call = self._close(self._block, self._buffer[len(CALL_START) : stop])
        if call is None:
            self._block = None
            self._reject(out)
            return True
        name, arguments = call
        deltas = [ToolCallDelta(self.calls, json.dumps(arguments, ensure_ascii=False))]
        if name is not None:
            deltas.insert(0, ToolCallDelta(self.calls, name=name, id=new_call_id()))
        self._commit(out, deltas)
        self.calls += 1
        self._block, self._buffer = None, self._buffer[stop + len(CALL_END) :]
        return True

    def _reject(self, out: ParsedText) -> None:
        """<tool_call> that opens no call is answer text; what follows it is scanned again."""
        self._answer(out, CALL_START)
        self._buffer = self._buffer[len(CALL_START) :]

    def _commit(self, out: ParsedText, deltas: list[ToolCallDelta]) -> None:
        self._pending_space, self._after_call = "", True
        out.tool_calls += deltas

    def _answer(self, out: ParsedText, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        body = text.rstrip()
        if body:
            out.content += self._pending_space + body
            self._pending_space = text[len(body) :]
        else:
            self._pending_space += text


class Qwen3CoderParser(ToolCallParser):
    """``<function=NAME>`` with ``<parameter=ARG>`` values (Qwen3.5, Qwen3-Coder)."""

    def _open(self, rest: str, final: bool) -> Any:
        body = rest.lstrip()
        if len(rest) - len(body) > MAX_LEADING_SPACE:
            return _REJECT
        closing = body.find(">")
        if closing != -1:
            name = body[len("<function=") : closing]
            return name if body.startswith("<function=") and name in self.tools else _REJECT
        could_be = any(f"<function={name}>".startswith(body) for name in self.tools)
        return _WAIT if could_be and not final else _REJECT

    def _header_deltas(self, header: Any) -> list[ToolCallDelta]:
        return [ToolCallDelta(self.calls, name=header, id=new_call_id())]

    def _close(self, header: Any, body: str) -> tuple[str | None, dict[str, Any]]:
        body = body[body.find(">") + 1 :]
        end = body.find(
            "</function>"
        )  # a call cut before </function> keeps its complete parameters
        schema = self.tools[header].get("properties")
        schema = schema if isinstance(schema, dict) else {}
        arguments = {}
        for match in _PARAMETER.finditer(body if end == -1 else body[:end]):
            name, value = match.group(1).strip(), _strip_newline(match.group(2))
            arguments[name] = convert_parameter(value, schema.get(name))
        return None, arguments


class Qwen25Parser(ToolCallParser):
    """A JSON object ``{"name", "arguments"}`` per block (Qwen2.5, Qwen3 dense)."""

    def _open(self, rest: str, final: bool) -> Any:
        body = rest.lstrip()
        if len(rest) - len(body) > MAX_LEADING_SPACE:
            return _REJECT
        if not body:
            return _REJECT if final else _WAIT
        return True if body.startswith("{") else _REJECT

    def _close(self, header: Any, body: str) -> tuple[str | None, dict[str, Any]] | None:
        try:
            call = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if not isinstance(call, dict) or call.get("name") not in self.tools:
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            arguments = _json_or_none(arguments)
        return (call["name"], arguments) if isinstance(arguments, dict) else None


def _strip_newline(value: str) -> str:
    """The template writes a value between two newlines; only those two are not part of it."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def convert_parameter(value: str, schema: Any) -> Any:
    """A ``<parameter>`` value as its schema's type: a string (or a parameter of no known type) stays text, any
    other type is parsed as JSON when it parses. ``null`` is None where the schema allows it."""
    types = schema_types(schema)
    if not types or "string" in types:
        return None if value == "null" and "null" in types else value
    parsed = _json_or_none(value)
    return parsed if parsed is not None or value.strip() == "null" else value


def schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema names, its ``anyOf`` / ``oneOf`` branches (one level) included."""
    if not isinstance(schema, dict):
        return set()
    types = _named_types(schema.get("type"))
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        for branch in branches if isinstance(branches, list) else []:
            types |= _named_types(branch.get("type")) if isinstance(branch, dict) else set()
    return types


def _named_types(named: Any) -> set[str]:
    return {t for t in (named if isinstance(named, list) else [named]) if isinstance(t, str)}


def _as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "qwen3_coder": Qwen3CoderParser,
    "qwen25": Qwen25Parser,
}


def create_tool_call_parser(name: str, tools: list[dict[str, Any]]) -> ToolCallParser:
    """``tools``: the request's function definitions (``name``, optional ``parameters`` schema)."""
    return TOOL_CALL_PARSERS[name](tools)
