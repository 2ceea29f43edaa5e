"""What a right 200 looks like for the hostile battery's answered cases: each ``*_ok`` returns a check, which takes
the parsed body (a JSON value, or a stream's list of events) and returns None when it is right, else why not."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

Check = Callable[[Any], "str | None"]
FINISHED = ("stop", "length")


def native_ok(
    results: int | None = None,
    tokens: int | None = None,
    pattern: str | None = None,
    json_prefix: bool = False,
) -> Check:
    """``/generate``: ``results`` answers (one object when None), each with text and a stop or length finish;
    ``tokens`` completion tokens each; text that ``pattern`` matches whole (when it stopped), or JSON (a JSON
    object's start when cut)."""

    def check(body: Any) -> str | None:
        answers = body if isinstance(body, list) else [body]
        if (results or 1) != len(answers) or (results is None and isinstance(body, list)):
            return f"{len(answers)} answers, not {results or 1}"
        for answer in answers:
            problem = _native_answer(answer, tokens, pattern, json_prefix)
            if problem:
                return problem
        return None

    return check


def _native_answer(
    answer: Any, tokens: int | None, pattern: str | None, json_prefix: bool
) -> str | None:
    if not isinstance(answer, dict) or not isinstance(answer.get("text"), str):
        return f"not a /generate answer: {str(answer)[:200]}"
    meta = answer.get("meta_info") or {}
    reason = (meta.get("finish_reason") or {}).get("type")
    text = answer["text"]
    if reason not in FINISHED:
        return f"finish reason {meta.get('finish_reason')}"
    if tokens is not None and meta.get("completion_tokens") != tokens:
        return f"{meta.get('completion_tokens')} completion tokens, not {tokens}"
    if pattern is not None and reason == "stop" and not re.fullmatch(pattern, text):
        return f"{text!r} does not match {pattern}"
    if json_prefix and not text.startswith("{"):
        return f"{text!r} is not a JSON object"
    if json_prefix and reason == "stop" and not _is_json(text):
        return f"{text!r} is not JSON"
    return None


def chat_ok(n: int = 1, json_content: bool = False) -> Check:
    """``/v1/chat/completions``: ``n`` choices, each an assistant message with a known finish reason; with
    ``json_content`` a choice that stopped holds JSON in its content."""

    def check(body: Any) -> str | None:
        choices = body.get("choices") if isinstance(body, dict) else None
        if not isinstance(choices, list) or len(choices) != n:
            return f"not {n} choices: {str(body)[:200]}"
        for choice in choices:
            message = choice.get("message") or {}
            reason = choice.get("finish_reason")
            if message.get("role") != "assistant" or reason not in (*FINISHED, "tool_calls"):
                return f"a bad choice: {str(choice)[:200]}"
            if json_content and reason == "stop" and not _is_json(message.get("content") or ""):
                return f"content {message.get('content')!r} is not JSON"
        return None

    return check


def completion_ok(n: int = 1, logprobs: bool = False) -> Check:
    """``/v1/completions``: ``n`` choices of text with a known finish reason (and log-probabilities)."""

    def check(body: Any) -> str | None:
        choices = body.get("choices") if isinstance(body, dict) else None
        if not isinstance(choices, list) or len(choices) != n:
            return f"not {n} choices: {str(body)[:200]}"
        for choice in choices:
            if (
                not isinstance(choice.get("text"), str)
                or choice.get("finish_reason") not in FINISHED
            ):
                return f"a bad choice: {str(choice)[:200]}"
            if logprobs and not (choice.get("logprobs") or {}).get("tokens"):
                return f"a choice without log-probabilities: {str(choice)[:200]}"
        return None

    return check


def openai_stream_ok(choices: int, usage: bool = False) -> Check:
    """An OpenAI stream: chunks for ``choices`` indices, each finished once, then ``[DONE]`` (usage before it)."""

    def check(events: Any) -> str | None:
        if not events or events[-1] != "[DONE]":
            return f"the stream does not end with [DONE]: {str(events[-2:])[:200]}"
        chunks = [e for e in events if isinstance(e, dict)]
        finished = [
            c["index"] for e in chunks for c in e.get("choices", []) if c.get("finish_reason")
        ]
        if sorted(finished) != list(range(choices)):
            return f"finished indices {sorted(finished)[:10]}..., not {choices} once each"
        if usage and not any(e.get("usage") for e in chunks):
            return "no usage chunk"
        return None

    return check


def native_stream_ok(results: int) -> Check:
    """SGLang's native stream: events for ``results`` indices, each ending finished, then ``[DONE]``."""

    def check(events: Any) -> str | None:
        if not events or events[-1] != "[DONE]":
            return "the stream does not end with [DONE]"
        last: dict[int, Any] = {}
        for event in events[:-1]:
            last[event.get("index", 0) if isinstance(event, dict) else -1] = event
        if sorted(last) != list(range(results)):
            return f"indices {sorted(last)}, not {results}"
        return next((p for e in last.values() if (p := _native_answer(e, None, None, False))), None)

    return check


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
