"""The FastAPI app: SGLang-native and OpenAI-compatible generation, loads, server info, health and metrics.

Handlers translate HTTP to ``GenerateInput``s and ``ReqOutput``s to HTTP; tokenising, routing and streaming live
in the tokenizer manager, the OpenAI shapes in ``openai_serving``.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from sglang_lite.runtime.inputs import split_prompts
from sglang_lite.scheduler.loads import LOAD_SECTIONS
from sglang_lite.server import openai_serving
from sglang_lite.server.disagg import bootstrap_of
from sglang_lite.server.dp_controller import requested_rank
from sglang_lite.server.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    ConcurrencyLimitMiddleware,
    RouteCountMiddleware,
)
from sglang_lite.server.model_info import VERSION, model_info_of, server_info_of
from sglang_lite.server.openai_protocol import AbortRequest, GenerateRequest
from sglang_lite.server.responses import (
    ClientDisconnected,
    SSEResponse,
    error_response,
    request_error_response,
    sse,
    sse_error,
    until_disconnect,
)
from sglang_lite.server.tokenizer_manager import (
    GenerateInput,
    RequestError,
    RequestStream,
    TokenizerManager,
    bad_request,
)
from sglang_lite.server_args import ServerArgs

HEALTH_GENERATE_TIMEOUT_S = 30.0
# Monitoring answers even when generation is saturated: never counted against --max-concurrent-requests.
UNLIMITED_PATHS = ("/health", "/metrics", "/v1/loads", "/get_load")


def create_app(args: ServerArgs, manager: TokenizerManager | None = None) -> FastAPI:
    manager = manager or TokenizerManager(args)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:  # a failed start still stops the ranks already spawned
            await manager.start()
            yield
        finally:
            await manager.shutdown()

    app = FastAPI(title="sglang_lite", version=VERSION, lifespan=lifespan)
    app.state.manager, app.state.args = manager, args
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_request_body_bytes)
    app.add_middleware(ConcurrencyLimitMiddleware, max_requests=args.max_concurrent_requests,
                       exempt_paths=UNLIMITED_PATHS)  # outside the body limit: refuses before reading a body
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key, open_paths=("/health",))
    app.add_middleware(RouteCountMiddleware, metrics=manager.metrics)  # outermost: counts 401s and 413s too
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
        return error_response(error.status_code, str(error.detail), error.headers)  # e.g. an unparsable body

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
        error = {"message": f"degraded: DP ranks alive: {manager.live}", "type": "ServiceUnavailable", "code": 503}
        return JSONResponse({"error": error, "status": "degraded", "ranks": manager.rank_states()}, status_code=503)

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
    async def loads(include: list[str] = Query(default=["all"]), dp_rank: int | None = None) -> dict[str, Any]:
        sections = _parse_include(include)
        loads = await manager.get_loads(_parse_dp_rank(dp_rank, args.dp_size), sections)
        return {"timestamp": datetime.now(timezone.utc).isoformat(), "version": VERSION, "loads": loads}

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        return [{"dp_rank": load["dp_rank"], "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
                 "num_waiting_reqs": load["num_waiting_reqs"], "num_tokens": load["num_total_tokens"]}
                for load in await manager.get_loads()]

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest) -> dict[str, Any]:
        if body.abort_all:
            return {"aborted": manager.abort_all()}
        return {"aborted": int(manager.abort(body.rid))}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> dict[str, Any]:
        """Drops every cached prefix no request is using (SGLang's route)."""
        return {"message": "Cache flushed.", "freed_tokens": await manager.flush_cache()}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        loads = await manager.get_loads([r for r in range(args.dp_size) if manager.live[r]])
        return PlainTextResponse(manager.metrics.render(loads), media_type="text/plain; version=0.0.4")

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        inputs, batched = await _generate_inputs(manager, body)
        if body.stream:
            if batched:
                raise bad_request("stream supports one prompt per request")
            stream = await until_disconnect(request, manager.submit(inputs[0]))
            return SSEResponse(_native_events(stream))
        results = await until_disconnect(request, manager.run_all(inputs))
        payload = [_native_result(r.new_token_ids, r.new_text, r.meta_info) for r in results]
        return JSONResponse(payload if batched else payload[0])


# ---- /generate -------------------------------------------------------------------------------------------------
async def _generate_inputs(manager: TokenizerManager, body: GenerateRequest) -> tuple[list[GenerateInput], bool]:
    if body.return_logprob is True or (isinstance(body.return_logprob, list) and any(body.return_logprob)):
        raise bad_request("return_logprob is not supported")
    try:
        prompts, is_text, batched = split_prompts(body.text, body.input_ids)
    except ValueError as error:
        raise bad_request(str(error)) from error
    manager.check_prompt_count(len(prompts), "text" if is_text else "input_ids")
    params = [manager.sampling_params(p) for p in _per_prompt(body.sampling_params, len(prompts), "sampling_params")]
    rids = _per_prompt(body.rid, len(prompts), "rid") if body.rid is not None else [None] * len(prompts)
    rank = requested_rank(body.routed_dp_rank, body.data_parallel_rank)
    try:
        pd = bootstrap_of(body.bootstrap_host, body.bootstrap_port, body.bootstrap_room, len(prompts))
    except ValueError as error:
        raise bad_request(str(error)) from error
    ids = [await manager.encode(p) for p in prompts] if is_text else prompts  # the sampling checks come first
    return [GenerateInput(rid or uuid.uuid4().hex, i, p, rank, b)
            for i, p, rid, b in zip(ids, params, rids, pd)], batched


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise bad_request(f"{name} has {len(value)} entries for {n} prompts")
    return value


def _native_result(ids: list[int], text: str, meta: dict[str, Any]) -> dict[str, Any]:
    return {"text": text, "output_ids": ids, "meta_info": meta}


async def _native_events(stream: RequestStream) -> AsyncIterator[bytes]:
    """SGLang's native stream: cumulative text and output ids in every event."""
    text, ids = "", []
    try:
        async for output in stream:
            text, ids = text + output.new_text, ids + output.new_token_ids
            yield sse(_native_result(ids, text, output.meta_info))
    except RequestError as error:
        yield sse_error(error)
    finally:
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
    inputs = [GenerateInput(f"health_generate_{uuid.uuid4().hex}", [0], one_token, rank)
              for rank in range(len(manager.live)) if manager.live[rank]]
    if len(inputs) < len(manager.live):
        return error_response(503, f"DP ranks alive: {manager.live}")
    started = time.monotonic()
    try:
        await manager.run_all(inputs, timeout=HEALTH_GENERATE_TIMEOUT_S)
    except (RequestError, TimeoutError) as error:
        return error_response(503, f"health generation failed: {error}")
    return JSONResponse({"healthy": True, "seconds": round(time.monotonic() - started, 4)})
