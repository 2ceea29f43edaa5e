"""The reasoning parser (``--reasoning-parser qwen3``): ``<think>``...``</think>`` becomes ``reasoning_content``.

Qwen3.5's chat template (as Qwen3-Thinking's) ends the generation prompt with ``<think>\\n``, so the output starts
inside the reasoning and only ``</think>`` appears; a prompt that closed its think block (``enable_thinking``
false) starts in the answer, where a leading ``<think>`` still opens reasoning. Reasoning is trimmed of the
whitespace around it, as is the start of the answer after ``</think>``; output that never closes its reasoning
(cut by ``max_tokens``) is all reasoning. SGLang's ``qwen3`` parser with ``force_reasoning`` behaves the same.
"""

from __future__ import annotations

from sglang_lite.sampling.grammar import REASONING_ENDS
from sglang_lite.server.parsers.base import ParsedText, partial_suffix

THINK_START = "<think>"
THINK_END = REASONING_ENDS["qwen3"]  # where a grammar after the reasoning starts too
# where a parser is in the text: before any think block, inside one, after it
_START = "start"
_REASONING = "reasoning"
_ANSWER = "answer"


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt leaves a think block open for the model to continue."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


class ReasoningParser:
    """Splits model text into reasoning and answer, incrementally."""

    def __init__(self, in_reasoning: bool) -> None:
        self._state = _REASONING if in_reasoning else _START
        self._buffer = ""
        self._pending_space = ""  # the reasoning's trailing whitespace, dropped if </think> follows
        self._reasoning_started = False
        # right after </think>: the answer's leading whitespace is dropped
        self._strip_answer = False

    def feed(self, text: str) -> ParsedText:
        self._buffer += text
        return self._parse(final=False)

    def finish(self) -> ParsedText:
        return self._parse(final=True)

    def _parse(self, final: bool) -> ParsedText:
        out = ParsedText()
        if self._state == _START:
            self._start(final)
        if self._state == _REASONING:
            out.reasoning = self._reasoning(final)
        if self._state == _ANSWER:
            out.content, self._buffer = self._answer(self._buffer), ""
        return out

    def _start(self, final: bool) -> None:
        head = self._buffer.lstrip()
        if head.startswith(THINK_START):
            self._buffer, self._state = head[len(THINK_START) :], _REASONING
        elif final or not THINK_START.startswith(head):
            self._state = _ANSWER

    def _reasoning(self, final: bool) -> str:
        end = self._buffer.find(THINK_END)
        if end != -1:
            text, self._buffer = self._buffer[:end], self._buffer[end + len(THINK_END) :]
            reasoning = self._trimmed(text, final=True)
            self._state, self._strip_answer = _ANSWER, True
            return reasoning
        keep = 0 if final else partial_suffix(self._buffer, THINK_END)
        text, self._buffer = (
            self._buffer[: len(self._buffer) - keep],
            self._buffer[len(self._buffer) - keep :],
        )
        return self._trimmed(text, final)

    def _trimmed(self, text: str, final: bool) -> str:
        """Reasoning text without its leading whitespace, its trailing whitespace held until more follows."""
        if not self._reasoning_started:
            text = text.lstrip()
            self._reasoning_started = bool(text)
        body = text.rstrip()
        if not body:
            self._pending_space = "" if final else self._pending_space + text
            return ""
        out, self._pending_space = self._pending_space + body, "" if final else text[len(body) :]
        return out

    def _answer(self, text: str) -> str:
        if self._strip_answer:
            text = text.lstrip()
            self._strip_answer = not text
        return text
