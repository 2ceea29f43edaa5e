"""``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models`` over the tokenizer manager (the response
objects are ``openai_shapes``)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sglang_lite.multimodal.inputs import ImageInputs
from sglang_lite.protocol.outputs import ReqOutput
from sglang_lite.sampling.logprobs import LogprobParams
from sglang_lite.sampling.params import SamplingParams
from sglang_lite.server.chat_render import check_chat_size
from sglang_lite.server.dp_controller import requested_rank
from sglang_lite.server.io_struct import GenerateInput, RequestError, bad_request, bootstrap_of
from sglang_lite.server.model_info import quantization_of, served_model_name
from sglang_lite.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _OpenAISampling,
)
from sglang_lite.server.openai_shapes import Shape, finish_reason, usage
from sglang_lite.server.openai_tools import (
    check_tools,
    parsing_plan,
    rendered_tools,
    requires_reasoning,
    tool_call_schema,
)
from sglang_lite.server.request_streams import RequestStream
from sglang_lite.server.responses import SSEResponse, sse, sse_error, until_disconnect
from sglang_lite.server.tokenizer_manager import TokenizerManager
from sglang_lite.server_args import ServerArgs

__all__ = ["Shape", "add_routes", "finish_reason", "merged", "usage"]

# OpenAI's default for /v1/completions; chat uses the server's (128)
COMPLETION_DEFAULT_MAX_TOKENS = 16


def add_routes(app: FastAPI, manager: TokenizerManager, args: ServerArgs) -> None:
    quantization = quantization_of(args)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {
            "id": served_model_name(args),
            "object": "model",
            "created": 0,
            "owned_by": "sglang_lite",
            "max_model_len": manager.config.context_length,
            **quantization,
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
            cache_report=args.enable_cache_report,
        )
        return await _respond(request, manager, body, inputs, shape)

    async def chat_size(request: Request) -> None:
        """Before pydantic validates the messages one by one: the raw JSON, parsed once and cached."""
        try:
            body = await request.json()
        except ValueError:
            return  # not JSON: the body's validation says so
        check_chat_size(body, manager.config.max_request_tokens)

    @app.post("/v1/chat/completions", dependencies=[Depends(chat_size)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs: true")
        if body.max_tokens is None and body.max_completion_tokens is not None:
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
        check_tools(body)
        # tool_choice required or a named function: the output is the calls
        forced = tool_call_schema(body)
        if forced is not None and (body.response_format is not None or body.regex or body.ebnf):
            raise bad_request(
                "tool_choice: a required or named tool choice constrains the output; it cannot be "
                "combined with response_format, regex or ebnf"
            )
        raw = {**body.sampling_dict(None), "require_reasoning": requires_reasoning(args, body)}
        params = manager.sampling_params(
            {**raw, "json_schema": forced} if forced is not None else raw
        )
        messages = [m.to_template() for m in body.messages]
        urls = [url for m in body.messages for url in m.image_urls()]
        prompt = await manager.encode_chat(
            messages, body.chat_template_kwargs or {}, rendered_tools(body)
        )
        ids, images = prompt.ids, None
        if urls:
            ids, images = await manager.attach_images(prompt.ids, urls)
        logprob = LogprobParams(True, -1, body.top_logprobs or 0) if body.logprobs else None
        inputs = _inputs(body, [ids], params, logprob, images)
        parsing = parsing_plan(args, body, prompt.text, forced=forced is not None)
        shape = Shape(
            "chat.completion",
            served_model_name(args),
            parsing,
            n=params.n,
            logprobs=logprob is not None,
            texts=manager.token_texts,
            forced_tools=forced is not None,
            cache_report=args.enable_cache_report,
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
    images: ImageInputs | None = None,
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
        GenerateInput(body.rid or uuid.uuid4().hex, ids, params, rank, b, logprob, images=images)
        for ids, b in zip(prompts, pd)
    ]


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
