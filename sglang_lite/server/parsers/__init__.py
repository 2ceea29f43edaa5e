"""Output parsers of chat completions: reasoning (``--reasoning-parser``) and tool calls (``--tool-call-parser``),
SGLang's flags and parser names. ``OutputParser`` chains them: reasoning first, tool calls in the answer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_lite.server.parsers.base import ParsedText, ToolCall, ToolCallDelta, join_tool_calls
from sglang_lite.server.parsers.reasoning import ReasoningParser, prompt_opens_reasoning
from sglang_lite.server.parsers.tool_calls import (
    TOOL_CALL_PARSERS,
    ToolCallParser,
    create_tool_call_parser,
)

REASONING_PARSERS = ("qwen3",)

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "OutputParser",
    "ParsedText",
    "ParsingPlan",
    "ToolCall",
    "ToolCallDelta",
    "join_tool_calls",
    "prompt_opens_reasoning",
]


@dataclass(frozen=True)
class ParsingPlan:
    """How one request's output is parsed: reasoning (and whether it starts inside it), tool calls (the parser's
    name and the request's functions). Each ``new()`` parser reads one choice."""

    reasoning: bool = False
    starts_in_reasoning: bool = False
    tool_parser: str | None = None
    tools: tuple[dict[str, Any], ...] = ()

    @property
    def active(self) -> bool:
        return self.reasoning or self.tool_parser is not None

    def new(self) -> OutputParser:
        reasoning = ReasoningParser(self.starts_in_reasoning) if self.reasoning else None
        tools = (
            create_tool_call_parser(self.tool_parser, list(self.tools))
            if self.tool_parser
            else None
        )
        return OutputParser(reasoning, tools)


class OutputParser:
    """Model text in, reasoning / answer / tool-call pieces out, incrementally."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None) -> None:
        self.reasoning, self.tools = reasoning, tools

    @property
    def saw_tool_calls(self) -> bool:
        return self.tools is not None and self.tools.calls > 0

    def feed(self, text: str) -> ParsedText:
        step = self.reasoning.feed(text) if self.reasoning else ParsedText(content=text)
        return self._answer(step, final=False)

    def finish(self) -> ParsedText:
        step = self.reasoning.finish() if self.reasoning else ParsedText()
        return self._answer(step, final=True)

    def parse(self, text: str) -> ParsedText:
        """A whole output at once."""
        out = self.feed(text)
        out += self.finish()
        return out

    def _answer(self, step: ParsedText, final: bool) -> ParsedText:
        if self.tools is None:
            return step
        out = ParsedText(reasoning=step.reasoning)
        out += self.tools.feed(step.content)
        if final:
            out += self.tools.finish()
        return out
