"""The interfaces of the output parsers: incremental, fed text deltas, and never raising on what a model writes.

A parser's ``feed`` returns what it can decide so far and holds back text that might still turn into a tag
(``<think`` at the end of a delta); ``finish`` releases the rest. Feeding a text whole or in any split gives the
same result, so the non-streaming response is the streaming parser fed once.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCallDelta:
    """One piece of a tool call, as OpenAI streams it: the first of a call carries its id and name."""

    index: int
    arguments: str = ""
    name: str | None = None
    id: str | None = None


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object


@dataclass
class ParsedText:
    """What one step of parsing decided: reasoning text, answer text, tool-call pieces."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __iadd__(self, other: ParsedText) -> ParsedText:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag`` (text to hold back)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def join_tool_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """The whole calls that a sequence of deltas streams."""
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        if delta.index not in calls:
            calls[delta.index] = ToolCall(delta.id or new_call_id(), delta.name or "", "")
        calls[delta.index].arguments += delta.arguments
    return [calls[i] for i in sorted(calls)]
