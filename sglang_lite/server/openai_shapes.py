"""The OpenAI response objects of ``/v1/completions`` and ``/v1/chat/completions``: whole responses, streamed
chunks (with parsed reasoning and tool calls, or constrained tool calls), log-probabilities and usage."""

from __future__ import annotations

import time
import uuid
from typing import Any

from sglang_lite.protocol.outputs import ReqOutput
from sglang_lite.server.openai_logprobs import CompletionLogprobs, TokenTexts, chat_logprobs
from sglang_lite.server.openai_tools import (
    forced_tool_message,
    parsed_deltas,
    parsed_message,
    tool_finish_reason,
)
from sglang_lite.server.parsers import OutputParser, ParsingPlan

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


class Shape:
    """The OpenAI object shapes of one endpoint: completion (``text``) or chat (``message`` / ``delta``), for ``n``
    choices per prompt (choice ``i`` answers prompt ``i // n``), with log-probabilities and echoed prompts."""

    def __init__(
        self,
        kind: str,
        model: str,
        parsing: ParsingPlan | None = None,
        n: int = 1,
        logprobs: bool = False,
        echo: list[str] | None = None,
        texts: TokenTexts | None = None,
        forced_tools: bool = False,
        cache_report: bool = False,
    ) -> None:
        self.kind = kind
        self.cache_report = cache_report  # --enable-cache-report: cached prompt tokens in usage
        self.model = model
        self.n = n
        # the output is a JSON list of tool calls (tool_call_schema)
        self.forced_tools = forced_tools
        self._forced_text: dict[int, str] = {}
        # chat: reasoning and tool calls parsed out of the text (openai_tools)
        self.parsing = parsing
        self.logprobs = logprobs
        self.echo = echo
        self.texts = texts
        self._stream_parsers: dict[int, OutputParser] = {}
        self._stream_logprobs: dict[int, CompletionLogprobs] = {}
        self.id = ("chatcmpl-" if self.is_chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    @property
    def is_chat(self) -> bool:
        return self.kind == "chat.completion"

    def response(self, results: list[ReqOutput]) -> dict[str, Any]:
        choices = [self._choice(i, r.new_text, r.meta_info) for i, r in enumerate(results)]
        return {
            **self._head(self.kind),
            "choices": choices,
            "usage": usage([r.meta_info for r in results], self.n, self.cache_report),
        }

    def chunks(
        self, index: int, output: ReqOutput, finish_reason: str | None, first: bool
    ) -> list[dict[str, Any]]:
        """The chunks of one streamed step of choice ``index``: one, or with parsing as many as the parsers found
        (maybe none; log-probabilities then come in a chunk of their own)."""
        logprobs = self._piece_logprobs(index, output.meta_info)
        if self.forced_tools:
            return self._forced_chunks(index, output.new_text, finish_reason, first, logprobs)
        if self.parsing is None:
            return [
                self._chunk(
                    index,
                    self._echoed(index, output.new_text, first),
                    finish_reason,
                    first,
                    logprobs,
                )
            ]
        chunks = self._parsed_chunks(index, output.new_text, finish_reason, first)
        if logprobs is not None and output.new_token_ids:
            chunks = chunks or [self._chunk(index, "", None, False, None)]
            chunks[0]["choices"][0]["logprobs"] = logprobs
        return chunks

    def _chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        first: bool,
        logprobs: dict[str, Any] | None,
    ) -> dict[str, Any]:
        if self.is_chat:
            delta = (
                {"role": "assistant", "content": text}
                if first
                else ({"content": text} if text else {})
            )
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        else:
            choice = {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        return {
            **self._head(self.kind + ".chunk" if self.is_chat else self.kind),
            "choices": [choice],
        }

    def _forced_chunks(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        first: bool,
        logprobs: dict[str, Any] | None,
    ) -> list[dict[str, Any]]:
        """Constrained tool calls stream as one delta once the list is complete (reasoning before it as it comes)."""
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if self.parsing is not None:
            parser = self._stream_parsers.setdefault(index, self.parsing.new())
            parsed = parser.feed(text)
            if finish_reason is not None:
                parsed += parser.finish()
            text = parsed.content
            if parsed.reasoning:
                delta["reasoning_content"] = parsed.reasoning
        self._forced_text[index] = self._forced_text.get(index, "") + text
        if finish_reason is not None:
            message = forced_tool_message(self._forced_text[index])
            calls = [{"index": i, **call} for i, call in enumerate(message.get("tool_calls", []))]
            delta.update({"tool_calls": calls} if calls else {"content": message["content"]})
            finish_reason = "tool_calls" if calls and finish_reason == "stop" else finish_reason
        if not delta and logprobs is None and finish_reason is None:
            return []
        head = self._head(self.kind + ".chunk")
        return [
            {
                **head,
                "choices": [
                    {
                        "index": index,
                        "delta": delta,
                        "logprobs": logprobs,
                        "finish_reason": finish_reason,
                    }
                ],
            }
        ]

    def _parsed_chunks(
        self, index: int, text: str, finish_reason: str | None, first: bool
    ) -> list[dict[str, Any]]:
        parser = self._stream_parsers.setdefault(index, self.parsing.new())
        parsed = parser.feed(text)
        if finish_reason is not None:
            parsed += parser.finish()
            finish_reason = tool_finish_reason(parser, finish_reason)
        deltas = parsed_deltas(parsed, first) or ([{}] if finish_reason else [])
        head = self._head(self.kind + ".chunk")
        chunks = [
            {
                **head,
                "choices": [{"index": index, "delta": d, "logprobs": None, "finish_reason": None}],
            }
            for d in deltas
        ]
        if chunks:
            chunks[-1]["choices"][0]["finish_reason"] = finish_reason
        return chunks

    def _piece_logprobs(self, index: int, meta: dict[str, Any]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.is_chat:
            return chat_logprobs(meta, self.texts)
        builder = self._stream_logprobs.setdefault(
            index, CompletionLogprobs(self.texts, self.echo is not None)
        )
        return builder.piece(meta)

    def _echoed(self, index: int, text: str, first: bool) -> str:
        return self.echo[index // self.n] + text if self.echo is not None and first else text

    def _forced_message(self, text: str) -> dict[str, Any]:
        """A forced tool call's whole ``message``, its reasoning apart when reasoning is parsed."""
        if self.parsing is None:
            return forced_tool_message(text)
        parsed = self.parsing.new().parse(text)
        return {
            **forced_tool_message(parsed.content),
            "reasoning_content": parsed.reasoning or None,
        }

    def usage_chunk(self, metas: list[dict[str, Any]]) -> dict[str, Any]:
        head = self._head(self.kind + ".chunk" if self.is_chat else self.kind)
        return {**head, "choices": [], "usage": usage(metas, self.n, self.cache_report)}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, index: int, text: str, meta: dict[str, Any]) -> dict[str, Any]:
        reason = finish_reason(meta)
        logprobs = None
        if self.logprobs:
            logprobs = (
                chat_logprobs(meta, self.texts)
                if self.is_chat
                else CompletionLogprobs(self.texts, self.echo is not None).piece(meta)
            )
        if self.is_chat and self.forced_tools:
            message = self._forced_message(text)
            reason = "tool_calls" if "tool_calls" in message and reason == "stop" else reason
            return {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": reason,
            }
        if self.is_chat and self.parsing is not None:
            parser = self.parsing.new()
            message = parsed_message(parser, text)
            return {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": tool_finish_reason(parser, reason),
            }
        if self.is_chat:
            return {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": reason,
            }
        return {
            "index": index,
            "text": self._echoed(index, text, True),
            "logprobs": logprobs,
            "finish_reason": reason,
        }


def finish_reason(meta: dict[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    return FINISH_REASONS.get(reason["type"]) if reason else None


def usage(metas: list[dict[str, Any]], n: int = 1, cache_report: bool = False) -> dict[str, Any]:
    """Token counts of a response whose choices come ``n`` per prompt: each prompt counts once; with
    ``cache_report`` (``--enable-cache-report``, as upstream) also the prompt tokens served from the cache."""
    prompt = sum(meta.get("prompt_tokens", 0) for meta in metas[::n])
    completion = sum(meta.get("completion_tokens", 0) for meta in metas)
    counts: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if cache_report:
        cached = sum(meta.get("cached_tokens", 0) for meta in metas[::n])
        counts["prompt_tokens_details"] = {"cached_tokens": cached}
    return counts
