"""``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``: OpenAI shapes over the tokenizer manager."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sglang_lite.sampling.params import SamplingParams
from sglang_lite.scheduler.request import ReqOutput
from sglang_lite.server.disagg import bootstrap_of
from sglang_lite.server.dp_controller import requested_rank
from sglang_lite.server.model_info import served_model_name
from sglang_lite.server.openai_protocol import ChatCompletionRequest, CompletionRequest, _OpenAISampling
from sglang_lite.server.responses import SSEResponse, sse, sse_error, until_disconnect
from sglang_lite.server.tokenizer_manager import (
    GenerateInput,
    RequestError,
    RequestStream,
    TokenizerManager,
    bad_request,
)
from sglang_lite.server_args import ServerArgs

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat uses the server's (128)
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def add_routes(app: FastAPI, manager: TokenizerManager, args: ServerArgs) -> None:
    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {"id": served_model_name(args), "object": "model", "created": 0, "owned_by": "sglang_lite",
                 "max_model_len": manager.config.context_length}
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        params = manager.sampling_params(body.sampling_dict(COMPLETION_DEFAULT_MAX_TOKENS))
        inputs = _inputs(body, await _completion_prompts(manager, body.prompt), params)
        return await _respond(request, manager, body, inputs, Shape("text_completion", served_model_name(args)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        if body.logprobs:
            raise bad_request("logprobs is not supported")
        if body.max_tokens is None and body.max_completion_tokens is not None:
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
        params = manager.sampling_params(body.sampling_dict(None))
        messages = [m.to_template() for m in body.messages]
        ids = await manager.encode_chat(messages, body.chat_template_kwargs or {})
        inputs = _inputs(body, [ids], params)
        return await _respond(request, manager, body, inputs, Shape("chat.completion", served_model_name(args)))


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


def _inputs(body: _OpenAISampling, prompts: list[list[int]], params: SamplingParams) -> list[GenerateInput]:
    rank = requested_rank(body.routed_dp_rank, body.data_parallel_rank)
    if body.rid is not None and len(prompts) > 1:
        raise bad_request("rid names one request; send one prompt with it")
    try:
        pd = bootstrap_of(body.bootstrap_host, body.bootstrap_port, body.bootstrap_room, len(prompts))
    except ValueError as error:
        raise bad_request(str(error)) from error
    return [GenerateInput(body.rid or uuid.uuid4().hex, ids, params, rank, b) for ids, b in zip(prompts, pd)]


class Shape:
    """The OpenAI object shapes of one endpoint: completion (``text``) or chat (``message`` / ``delta``)."""

    def __init__(self, kind: str, model: str) -> None:
        self.kind, self.model = kind, model
        self.id = ("chatcmpl-" if self.is_chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    @property
    def is_chat(self) -> bool:
        return self.kind == "chat.completion"

    def response(self, results: list[ReqOutput]) -> dict[str, Any]:
        choices = [self._choice(i, r.new_text, r.meta_info) for i, r in enumerate(results)]
        return {**self._head(self.kind), "choices": choices, "usage": usage([r.meta_info for r in results])}

    def chunk(self, text: str, finish_reason: str | None, first: bool = False) -> dict[str, Any]:
        if self.is_chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(self.kind + ".chunk" if self.is_chat else self.kind), "choices": [choice]}

    def usage_chunk(self, meta: dict[str, Any]) -> dict[str, Any]:
        head = self._head(self.kind + ".chunk" if self.is_chat else self.kind)
        return {**head, "choices": [], "usage": usage([meta])}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, index: int, text: str, meta: dict[str, Any]) -> dict[str, Any]:
        reason = finish_reason(meta)
        if self.is_chat:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": reason}
        return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}


def finish_reason(meta: dict[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    return FINISH_REASONS.get(reason["type"]) if reason else None


def usage(metas: list[dict[str, Any]]) -> dict[str, int]:
    prompt = sum(meta.get("prompt_tokens", 0) for meta in metas)
    completion = sum(meta.get("completion_tokens", 0) for meta in metas)
    cached = sum(meta.get("cached_tokens", 0) for meta in metas)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _respond(request: Request, manager: TokenizerManager, body: _OpenAISampling, inputs: list[GenerateInput],
                   shape: Shape) -> Response:
    if not body.stream:
        results = await until_disconnect(request, manager.run_all(inputs))
        return JSONResponse(shape.response(results))
    if len(inputs) != 1:
        raise bad_request("stream supports one prompt per request")
    stream = await until_disconnect(request, manager.submit(inputs[0]))
    return SSEResponse(_events(stream, shape, body.include_usage))


async def _events(stream: RequestStream, shape: Shape, include_usage: bool) -> AsyncIterator[bytes]:
    meta: dict[str, Any] = {}
    try:
        first = True
        async for output in stream:
            meta = output.meta_info
            reason = finish_reason(meta) if output.finished else None
            if output.new_text or reason or first:
                yield sse(shape.chunk(output.new_text, reason, first=first and shape.is_chat))
                first = False
    except RequestError as error:
        yield sse_error(error)
    finally:
        stream.close()
    if include_usage and meta:
        yield sse(shape.usage_chunk(meta))
    yield sse("[DONE]")
