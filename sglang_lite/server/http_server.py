"""The FastAPI app: SGLang-native and OpenAI-compatible generation, loads, server info, health and metrics.

Handlers translate HTTP to ``GenerateInput``s and ``ReqOutput``s to HTTP; tokenising, routing and streaming live
in the tokenizer manager, the OpenAI shapes in ``openai_serving``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any, Callable

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from sglang_lite.multimodal.media import image_data_url
from sglang_lite.protocol.loads import LOAD_SECTIONS
from sglang_lite.runtime.inputs import per_prompt, split_prompts
from sglang_lite.sampling.logprobs import INPUT_KEYS, OUTPUT_KEYS, LogprobParams
from sglang_lite.server import openai_serving
from sglang_lite.server.dp_controller import requested_rank
from sglang_lite.server.io_struct import (
    GenerateInput,
    RequestError,
    bad_request,
    bootstrap_of,
)
from sglang_lite.server.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    ConcurrencyLimitMiddleware,
    RouteCountMiddleware,
)
from sglang_lite.server.model_info import VERSION, model_info_of, server_info_of
from sglang_lite.server.openai_protocol import (
    AbortRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
)
from sglang_lite.server.request_streams import RequestStream
from sglang_lite.server.responses import (
    ClientDisconnected,
    SSEResponse,
    error_response,
    request_error_response,
    sse,
    sse_error,
    until_disconnect,
)
from sglang_lite.server.tokenizer_manager import TokenizerManager
from sglang_lite.server_args import ServerArgs

HEALTH_GENERATE_TIMEOUT_S = 30.0
# Monitoring answers even when generation is saturated: never counted against --max-concurrent-requests.
UNLIMITED_PATHS = ("/health", "/metrics", "/v1/loads", "/get_load")


def create_app(args: ServerArgs, manager: TokenizerManager | None = None) -> FastAPI:
    manager = manager or TokenizerManager(args)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:  # a failed start still stops the ranks already spawned
            try:
                await manager.start()
            except Exception as error:
                if not app.state.keep_startup_error:
                    raise
                app.state.startup_error = error  # launch_server says it in one line and exits
            yield
        finally:
            await manager.shutdown()

    app = FastAPI(title="sglang_lite", version=VERSION, lifespan=lifespan)
    app.state.manager = manager
    app.state.args = args
    # launch_server: a failed start is kept here instead of raised (uvicorn would print its traceback)
    app.state.keep_startup_error = False
    app.state.startup_error = None
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_request_body_bytes)
    app.add_middleware(
        ConcurrencyLimitMiddleware,
        max_requests=args.max_concurrent_requests,
        exempt_paths=UNLIMITED_PATHS,
    )  # outside the body limit: refuses before reading a body
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key, open_paths=("/health",))
    app.add_middleware(
        RouteCountMiddleware, metrics=manager.metrics
    )  # outermost: counts 401s and 413s too
    _add_error_handlers(app)
    _add_routes(app, manager, args)
    openai_serving.add_routes(app, manager, args)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(400, _describe_validation(error))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> Response:
        if error.status_code < 400:
            return Response(status_code=error.status_code, headers=error.headers)
        return error_response(
            error.status_code, str(error.detail), error.headers
        )  # e.g. an unparsable body

    @app.exception_handler(RequestError)
    async def refused(request: Request, error: RequestError) -> JSONResponse:
        return request_error_response(error)

    @app.exception_handler(ClientDisconnected)
    async def gone(request: Request, error: ClientDisconnected) -> Response:
        return Response(status_code=499)


def _describe_validation(error: RequestValidationError) -> str:
    parts = []
    for item in error.errors()[:5]:
        where = ".".join(str(x) for x in item.get("loc", ()) if x != "body") or "body"
        parts.append(f"{where}: {item.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


def _add_routes(app: FastAPI, manager: TokenizerManager, args: ServerArgs) -> None:
    @app.get("/health")
    async def health() -> Response:
        """200 while every rank is up; else 503, degraded, with each rank's state (up, starting, down, failed)."""
        if all(manager.live):
            return Response(status_code=200)
        error = {
            "message": f"degraded: DP ranks alive: {manager.live}",
            "type": "ServiceUnavailable",
            "code": 503,
        }
        return JSONResponse(
            {"error": error, "status": "degraded", "ranks": manager.rank_states()}, status_code=503
        )

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        return await _health_generate(manager)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return server_info_of(manager, args)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return model_info_of(manager, args)

    @app.get("/v1/loads")
    async def loads(
        include: list[str] = Query(default=["all"]), dp_rank: int | None = None
    ) -> dict[str, Any]:
        sections = _parse_include(include)
        loads = await manager.get_loads(_parse_dp_rank(dp_rank, args.dp_size), sections)
        return {
            "timestamp": datetime.now(timezone.utc).isoformat(),
            "version": VERSION,
            "loads": loads,
        }

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        return [
            {
                "dp_rank": load["dp_rank"],
                "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
                "num_waiting_reqs": load["num_waiting_reqs"],
                "num_tokens": load["num_total_tokens"],
            }
            for load in await manager.get_loads(sections=("core",))
        ]

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest) -> dict[str, Any]:
        if body.abort_all:
            return {"aborted": manager.abort_all()}
        if body.bootstrap_room is not None:  # PD: a router's word that the prefill leg failed
            rooms = body.bootstrap_room
            rooms = rooms if isinstance(rooms, list) else [rooms]
            failure = (body.error, body.status_code, body.settled)
            return {"aborted": manager.pd.fail_rooms(rooms, *failure)}
        return {"aborted": int(manager.abort(body.rid))}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> dict[str, Any]:
        """Drops every cached prefix no request is using (SGLang's route)."""
        return {"message": "Cache flushed.", "freed_tokens": await manager.flush_cache()}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        ids = await manager.encode(body.prompt, "prompt", body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": manager.config.context_length}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        if manager.tokenizer is None:
            raise bad_request("detokenize needs a tokenizer (the server skipped tokenizer init)")
        vocab = manager.config.vocab_size
        if not all(0 <= t < vocab for t in body.tokens):
            raise bad_request(f"tokens must be token ids in [0, {vocab})")
        text = manager.tokenizer.decode(body.tokens)
        return {"text": text, "prompt": text}  # SGLang's key, vLLM's key

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        """The tokenizer's special tokens and chat template (vLLM's route, which lm-evaluation-harness probes)."""
        tokenizer = manager.tokenizer
        if tokenizer is None:
            raise RequestError(404, "the server skipped tokenizer init")
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token,
            "pad_token": tokenizer.pad_token,
            "chat_template": getattr(tokenizer, "chat_template", None),
            "model_max_length": manager.config.context_length,
            "vocab_size": manager.config.vocab_size,
        }

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        loads = await manager.get_loads([r for r in range(args.dp_size) if manager.live[r]])
        return PlainTextResponse(
            manager.metrics.render(loads), media_type="text/plain; version=0.0.4"
        )

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        inputs, batched = await _generate_inputs(manager, body)
        if body.stream:
            if batched:
                raise bad_request("stream supports one prompt per request")
            streams = await until_disconnect(request, manager.submit_samples(inputs[0]))
            return SSEResponse(_native_events(streams, _logprob_texts(manager, body)))
        results = await until_disconnect(request, manager.run_all(inputs))
        texts = _logprob_texts(manager, body)
        payload = [_native_result(r.new_token_ids, r.new_text, texts(r.meta_info)) for r in results]
        return JSONResponse(
            payload if batched or len(payload) > 1 else payload[0]
        )  # n > 1: n results


# ---- /generate -------------------------------------------------------------------------------------------------
async def _generate_inputs(
    manager: TokenizerManager, body: GenerateRequest
) -> tuple[list[GenerateInput], bool]:
    try:
        prompts = split_prompts(body.text, body.input_ids)
    except ValueError as error:
        raise bad_request(str(error)) from error
    n = len(prompts.items)
    manager.check_prompt_count(n, "text" if prompts.is_text else "input_ids")
    params = [
        manager.sampling_params(p) for p in _per_prompt(body.sampling_params, n, "sampling_params")
    ]
    reasoning = _per_prompt(body.require_reasoning, n, "require_reasoning")
    params = [replace(p, require_reasoning=True) if r else p for p, r in zip(params, reasoning)]
    rids = _per_prompt(body.rid, n, "rid") if body.rid is not None else [None] * n
    rank = requested_rank(body.routed_dp_rank, body.data_parallel_rank)
    try:
        pd = bootstrap_of(body.bootstrap_host, body.bootstrap_port, body.bootstrap_room, n)
    except ValueError as error:
        raise bad_request(str(error)) from error
    logprobs = _logprob_params(body, n)
    # the sampling checks come first
    ids = [await manager.encode(p) for p in prompts.items] if prompts.is_text else prompts.items
    images = [None] * n
    if body.image_data:
        # SGLang's image_data: the images of one prompt, whose text holds their placeholders
        if n != 1:
            raise bad_request("image_data: send one prompt with its images")
        urls = [body.image_data] if isinstance(body.image_data, str) else list(body.image_data)
        ids[0], images[0] = await manager.attach_images(ids[0], [image_data_url(u) for u in urls])
    return [
        GenerateInput(rid or uuid.uuid4().hex, i, p, rank, b, lp, images=im)
        for i, p, rid, b, lp, im in zip(ids, params, rids, pd, logprobs, images)
    ], prompts.batched


def _logprob_params(body: GenerateRequest, n: int) -> list[LogprobParams | None]:
    """Each prompt's log-probability request: every field is one value for all prompts or a list of one each."""
    asks = _per_prompt(body.return_logprob, n, "return_logprob")
    starts = _per_prompt(body.logprob_start_len, n, "logprob_start_len")
    tops = _per_prompt(body.top_logprobs_num, n, "top_logprobs_num")
    ids = body.token_ids_logprob
    ids = (
        _per_prompt(ids, n, "token_ids_logprob") if ids and isinstance(ids[0], list) else [ids] * n
    )
    params = []
    for ask, start, top, chosen in zip(asks, starts, tops, ids):
        if not ask and (start != -1 or top or chosen is not None):
            raise bad_request(
                "logprob_start_len, top_logprobs_num and token_ids_logprob need return_logprob"
            )
        params.append(LogprobParams(True, start, top, chosen) if ask else None)
    return params


def _logprob_texts(
    manager: TokenizerManager, body: GenerateRequest
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """``return_text_in_logprobs``: fills each log-probability entry's text (its third place) in a meta_info."""

    def fill(meta: dict[str, Any]) -> dict[str, Any]:
        if body.return_text_in_logprobs:
            for key in [k for k in (*OUTPUT_KEYS, *INPUT_KEYS) if k in meta]:
                meta[key] = [_with_texts(manager, position) for position in meta[key]]
        return meta

    return fill


def _with_texts(manager: TokenizerManager, position: list | None) -> list | None:
    """One position's entry [logprob, id, text], or its list of them (top-k, chosen ids), with texts."""
    if not position:
        return position
    if isinstance(position[0], list):
        texts = manager.token_texts([entry[1] for entry in position])
        return [[entry[0], entry[1], text] for entry, text in zip(position, texts)]
    return [position[0], position[1], manager.token_texts([position[1]])[0]]


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    try:
        return per_prompt(value, n, name)
    except ValueError as error:
        raise bad_request(str(error)) from error


def _native_result(ids: list[int], text: str, meta: dict[str, Any]) -> dict[str, Any]:
    return {"text": text, "output_ids": ids, "meta_info": meta}


async def _native_events(
    streams: list[RequestStream], texts: Callable[[dict], dict]
) -> AsyncIterator[bytes]:
    """SGLang's native stream: cumulative text, output ids and log-probabilities in every event; with ``n`` > 1
    the samples' events interleave, each with its ``index``."""
    text = [""] * len(streams)
    ids: list[list[int]] = [[] for _ in streams]
    logprobs: list[dict[str, list]] = [{} for _ in streams]
    try:
        async for i, output in openai_serving.merged(streams):
            text[i], ids[i] = text[i] + output.new_text, ids[i] + output.new_token_ids
            for key in [k for k in (*OUTPUT_KEYS, *INPUT_KEYS) if k in output.meta_info]:
                logprobs[i].setdefault(key, []).extend(texts({key: output.meta_info[key]})[key])
            event = _native_result(ids[i], text[i], {**output.meta_info, **logprobs[i]})
            yield sse({**event, "index": i} if len(streams) > 1 else event)
    except RequestError as error:
        yield sse_error(error)
    finally:
        for stream in streams:
            stream.close()
    yield sse("[DONE]")


# ---- loads -----------------------------------------------------------------------------------------------------
def _parse_include(values: list[str]) -> tuple[str, ...]:
    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    unknown = sorted(set(names) - {*LOAD_SECTIONS, "all"})
    if unknown:
        raise bad_request(f"unknown include name(s) {unknown}; known: {[*LOAD_SECTIONS, 'all']}")
    if not names or "all" in names:
        return LOAD_SECTIONS
    return tuple(s for s in LOAD_SECTIONS if s in names)


def _parse_dp_rank(dp_rank: int | None, dp_size: int) -> list[int] | None:
    if dp_rank is None:
        return None
    if not 0 <= dp_rank < dp_size:
        raise bad_request(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    return [dp_rank]


# ---- health ----------------------------------------------------------------------------------------------------
async def _health_generate(manager: TokenizerManager) -> Response:
    """One token on every live rank, each within the timeout."""
    one_token = manager.sampling_params({"max_new_tokens": 1})
    inputs = [
        GenerateInput(f"health_generate_{uuid.uuid4().hex}", [0], one_token, rank, local=True)
        for rank in range(len(manager.live))
        if manager.live[rank]
    ]
    if len(inputs) < len(manager.live):
        return error_response(503, f"DP ranks alive: {manager.live}")
    started = time.monotonic()
    try:
        await manager.run_all(inputs, timeout=HEALTH_GENERATE_TIMEOUT_S)
    except (RequestError, TimeoutError) as error:
        return error_response(503, f"health generation failed: {error}")
    return JSONResponse({"healthy": True, "seconds": round(time.monotonic() - started, 4)})
