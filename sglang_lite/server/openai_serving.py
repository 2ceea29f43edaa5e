"""``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``: OpenAI shapes over the tokenizer manager."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sglang_lite.protocol.outputs import ReqOutput
from sglang_lite.sampling.logprobs import LogprobParams
from sglang_lite.sampling.params import SamplingParams
from sglang_lite.server.disagg import bootstrap_of
from sglang_lite.server.dp_controller import requested_rank
from sglang_lite.server.model_info import served_model_name
from sglang_lite.server.openai_logprobs import CompletionLogprobs, TokenTexts, chat_logprobs
from sglang_lite.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _OpenAISampling,
)
from sglang_lite.server.openai_tools import (
    check_tools,
    forced_tool_message,
    parsed_deltas,
    parsed_message,
    parsing_plan,
    rendered_tools,
    tool_call_schema,
    tool_finish_reason,
)
from sglang_lite.server.parsers import OutputParser, ParsingPlan
from sglang_lite.server.responses import SSEResponse, sse, sse_error, until_disconnect
from sglang_lite.server.tokenizer_manager import (
    GenerateInput,
    RequestError,
    RequestStream,
    TokenizerManager,
    bad_request,
)
from sglang_lite.server_args import ServerArgs

COMPLETION_DEFAULT_MAX_TOKENS = (
    16  # OpenAI's default for /v1/completions; chat uses the server's (128)
)
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def add_routes(app: FastAPI, manager: TokenizerManager, args: ServerArgs) -> None:
    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {
            "id": served_model_name(args),
            "object": "model",
            "created": 0,
            "owned_by": "sglang_lite",
            "max_model_len": manager.config.context_length,
        }
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        params = manager.sampling_params(body.sampling_dict(COMPLETION_DEFAULT_MAX_TOKENS))
        prompts = await _completion_prompts(manager, body.prompt)
        # logprobs: the top ``logprobs`` besides the chosen token; with echo, the prompt's tokens too
        logprob = (
            LogprobParams(True, 0 if body.echo else -1, body.logprobs)
            if body.logprobs is not None
            else None
        )
        inputs = _inputs(body, prompts, params, logprob)
        echo = (
            [_prompt_text(manager, body.prompt, i, ids) for i, ids in enumerate(prompts)]
            if body.echo
            else None
        )
        shape = Shape(
            "text_completion",
            served_model_name(args),
            n=params.n,
            logprobs=logprob is not None,
            echo=echo,
            texts=manager.token_texts,
        )
        return await _respond(request, manager, body, inputs, shape)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs: true")
        if body.max_tokens is None and body.max_completion_tokens is not None:
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
        check_tools(body)
        forced = tool_call_schema(
            body
        )  # tool_choice required or a named function: the output is the calls
        if forced is not None and (body.response_format is not None or body.regex or body.ebnf):
            raise bad_request(
                "tool_choice: a required or named tool choice constrains the output; it cannot be "
                "combined with response_format, regex or ebnf"
            )
        raw = body.sampling_dict(None)
        params = manager.sampling_params(
            {**raw, "json_schema": forced} if forced is not None else raw
        )
        messages = [m.to_template() for m in body.messages]
        prompt = await manager.encode_chat(
            messages, body.chat_template_kwargs or {}, rendered_tools(body)
        )
        logprob = LogprobParams(True, -1, body.top_logprobs or 0) if body.logprobs else None
        inputs = _inputs(body, [prompt.ids], params, logprob)
        parsing = parsing_plan(args, body, prompt.text) if forced is None else None
        shape = Shape(
            "chat.completion",
            served_model_name(args),
            parsing,
            n=params.n,
            logprobs=logprob is not None,
            texts=manager.token_texts,
            forced_tools=forced is not None,
        )
        return await _respond(request, manager, body, inputs, shape)


async def _completion_prompts(manager: TokenizerManager, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [await manager.encode(prompt, "prompt")]
    if not prompt:
        raise bad_request("prompt: the list is empty")
    if not isinstance(prompt[0], int):
        manager.check_prompt_count(len(prompt), "prompt")
    if isinstance(prompt[0], str):
        return [await manager.encode(p, "prompt") for p in prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


def _prompt_text(manager: TokenizerManager, prompt: Any, index: int, ids: list[int]) -> str:
    """What ``echo`` repeats: the prompt as sent when it was text, else its tokens decoded."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[index]
    return manager.tokenizer.decode(ids) if manager.tokenizer is not None else ""


def _inputs(
    body: _OpenAISampling,
    prompts: list[list[int]],
    params: SamplingParams,
    logprob: LogprobParams | None = None,
) -> list[GenerateInput]:
    rank = requested_rank(body.routed_dp_rank, body.data_parallel_rank)
    if body.rid is not None and len(prompts) > 1:
        raise bad_request("rid names one request; send one prompt with it")
    try:
        pd = bootstrap_of(
            body.bootstrap_host, body.bootstrap_port, body.bootstrap_room, len(prompts)
        )
    except ValueError as error:
        raise bad_request(str(error)) from error
    return [
        GenerateInput(body.rid or uuid.uuid4().hex, ids, params, rank, b, logprob)
        for ids, b in zip(prompts, pd)
    ]


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
    ) -> None:
        self.kind, self.model, self.n = kind, model, n
        self.forced_tools = (
            forced_tools  # the output is a JSON list of tool calls (tool_call_schema)
        )
        self._forced_text: dict[int, str] = {}
        self.parsing = (
            parsing  # chat: reasoning and tool calls parsed out of the text (openai_tools)
        )
        self.logprobs, self.echo, self.texts = logprobs, echo, texts
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
            "usage": usage([r.meta_info for r in results], self.n),
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
        """Constrained tool calls stream as one delta once the list is complete."""
        self._forced_text[index] = self._forced_text.get(index, "") + text
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
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

    def usage_chunk(self, metas: list[dict[str, Any]]) -> dict[str, Any]:
        head = self._head(self.kind + ".chunk" if self.is_chat else self.kind)
        return {**head, "choices": [], "usage": usage(metas, self.n)}

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
            message = forced_tool_message(text)
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


def usage(metas: list[dict[str, Any]], n: int = 1) -> dict[str, int]:
    """Token counts of a response whose choices come ``n`` per prompt: each prompt counts once."""
    prompt = sum(meta.get("prompt_tokens", 0) for meta in metas[::n])
    completion = sum(meta.get("completion_tokens", 0) for meta in metas)
    cached = sum(meta.get("cached_tokens", 0) for meta in metas[::n])
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def _respond(
    request: Request,
    manager: TokenizerManager,
    body: _OpenAISampling,
    inputs: list[GenerateInput],
    shape: Shape,
) -> Response:
    if not body.stream:
        results = await until_disconnect(request, manager.run_all(inputs))
        return JSONResponse(shape.response(results))
    if len(inputs) != 1:
        raise bad_request("stream supports one prompt per request")
    streams = await until_disconnect(request, manager.submit_samples(inputs[0]))
    return SSEResponse(_events(streams, shape, body.include_usage))


async def _events(
    streams: list[RequestStream], shape: Shape, include_usage: bool
) -> AsyncIterator[bytes]:
    """The choices' chunks as their outputs arrive (interleaved when ``n`` > 1), then usage and ``[DONE]``."""
    metas: dict[int, dict[str, Any]] = {}
    started: set[int] = set()
    try:
        async for index, output in merged(streams):
            metas[index] = output.meta_info
            reason = finish_reason(output.meta_info) if output.finished else None
            first = index not in started
            if output.new_text or reason or first or (shape.logprobs and output.new_token_ids):
                for chunk in shape.chunks(index, output, reason, first=first):
                    yield sse(chunk)
                    started.add(index)
    except RequestError as error:
        yield sse_error(error)
    finally:
        for stream in streams:
            stream.close()
    if include_usage and metas:
        yield sse(shape.usage_chunk([metas[i] for i in sorted(metas)]))
    yield sse("[DONE]")


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, ReqOutput]]:
    """(stream index, output) from all streams in arrival order; a stream's RequestError is raised."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    arrivals: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                arrivals.put_nowait((index, output))
        except RequestError as error:
            arrivals.put_nowait((index, error))
        arrivals.put_nowait((index, None))

    pumps = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        ended = 0
        while ended < len(streams):
            index, item = await arrivals.get()
            if isinstance(item, RequestError):
                raise item
            if item is None:
                ended += 1
            else:
                yield index, item
    finally:
        for task in pumps:
            task.cancel()
