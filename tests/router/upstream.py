"""A small but honest stand-in for an sglang_lite server, for the few router tests a real server cannot serve:
it records the bodies it received (/_stats) and answers with millisecond-steady timing. The other end-to-end
tests run against real sglang_lite servers (conftest.py).

It serves the endpoints the router uses with the same schemas (router.md): /health, /server_info,
/get_server_info, /v1/loads, /get_load, /generate, /v1/completions, /v1/chat/completions (with and without SSE
streaming) and /v1/models. "Generation" emits `max_new_tokens` tokens, one every `--token-delay` seconds, on the
DP rank named by `routed_dp_rank` (or `data_parallel_rank`), else on its least busy rank, as a DP controller
would. /_stats (test-only) reports what it received.

Failure modes, like a real server's: `--max-concurrency N` sheds a request arriving while N run (503 with
`Retry-After: --retry-after`, as a full waiting queue does); `--api-key K` requires `Authorization: Bearer K` on every
route but /health and the test-only ones; `POST /_rank?rank=N&alive=0|1` (test-only) kills or revives rank N: a
request for it answers 503 "DP rank N is not alive" (Retry-After: 5), /health answers 503 while any rank is down,
and /v1/loads answers 503 when it asks about a dead rank.

Run: python tests/router/upstream.py --port 0 --dp-size 2 --token-delay 0.01   (prints "READY port=N")
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import sys
from collections import Counter
from dataclasses import dataclass, field

from aiohttp import web

INCLUDE_NAMES = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}


@dataclass
class Running:
    rank: int
    prompt_tokens: int
    generated: int = 0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.generated


@dataclass
class State:
    dp_size: int
    token_delay: float
    name: str
    max_concurrency: int = 0  # 0: unlimited
    retry_after: int = 1
    api_key: str | None = None
    dead: set[int] = field(default_factory=set)
    shed: int = 0
    running: dict[int, Running] = field(default_factory=dict)
    by_rank: Counter = field(default_factory=Counter)
    completed: int = 0
    aborted: int = 0
    bodies: list[dict] = field(default_factory=list)
    aborts: list[dict] = field(default_factory=list)  # bodies of /abort_request
    ids: itertools.count = field(default_factory=itertools.count)

    def pick_rank(self, body: dict) -> int:
        rank = body.get("routed_dp_rank", body.get("data_parallel_rank"))
        if isinstance(rank, int) and 0 <= rank < self.dp_size:
            return rank
        load = Counter(r.rank for r in self.running.values())
        live = [r for r in range(self.dp_size) if r not in self.dead] or [0]
        return min(live, key=lambda r: load[r])

    def rank_load(self, rank: int) -> dict:
        reqs = [r for r in self.running.values() if r.rank == rank]
        now = datetime.datetime.now(datetime.timezone.utc).isoformat()
        tokens = sum(r.tokens for r in reqs)
        return {
            "dp_rank": rank,
            "timestamp": now,
            "num_running_reqs": len(reqs),
            "num_waiting_reqs": 0,
            "num_used_tokens": tokens,
            "num_total_tokens": tokens,
            "max_total_num_tokens": 100000,
            "token_usage": tokens / 100000,
            "gen_throughput": 0.0,
            "cache_hit_rate": 0.0,
            "utilization": tokens / 100000,
            "max_running_requests": 256,
        }


def prompt_of(body: dict) -> str:
    for key in ("text", "prompt"):
        if isinstance(body.get(key), str):
            return body[key]
    msgs = body.get("messages") or []
    return " ".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict))


def max_tokens_of(body: dict) -> int:
    params = body.get("sampling_params") or {}
    return int(
        params.get("max_new_tokens")
        or body.get("max_tokens")
        or body.get("max_completion_tokens")
        or 8
    )


async def generate_tokens(state: State, body: dict):
    """Yields (rank, token text); counts the request as running on its rank meanwhile."""
    rid = next(state.ids)
    run = Running(state.pick_rank(body), prompt_tokens=max(1, len(prompt_of(body).split())))
    state.running[rid] = run
    state.by_rank[run.rank] += 1
    finished = False
    try:
        for i in range(max_tokens_of(body)):
            if state.token_delay:
                await asyncio.sleep(state.token_delay)
            run.generated += 1
            yield run.rank, f" tok{i}"
        finished = True
    finally:
        del state.running[rid]
        if finished:
            state.completed += 1
        else:
            state.aborted += 1


def chunk_json(route: str, text: str, rank: int, done: bool) -> dict:
    if route == "/generate":
        return {
            "text": text,
            "meta_info": {"dp_rank": rank, "finish_reason": "length" if done else None},
        }
    if route == "/v1/chat/completions":
        return {
            "object": "chat.completion.chunk",
            "model": "upstream",
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": text},
                    "finish_reason": "length" if done else None,
                }
            ],
        }
    return {
        "object": "text_completion",
        "model": "upstream",
        "choices": [{"index": 0, "text": text, "finish_reason": "length" if done else None}],
    }


def full_json(route: str, text: str, rank: int, n_tokens: int) -> dict:
    if route == "/generate":
        return {
            "text": text,
            "meta_info": {
                "dp_rank": rank,
                "completion_tokens": n_tokens,
                "finish_reason": "length",
            },
        }
    usage = {"completion_tokens": n_tokens}
    if route == "/v1/chat/completions":
        return {
            "object": "chat.completion",
            "model": "upstream",
            "usage": usage,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length",
                }
            ],
        }
    return {
        "object": "text_completion",
        "model": "upstream",
        "usage": usage,
        "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
    }


def make_app(state: State) -> web.Application:
    async def infer(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "invalid JSON"}, status=400)
        state.bodies.append(body)
        refusal = refuse(state, body)
        if refusal is not None:
            return refusal
        if (
            max_tokens_of(body) < 0
        ):  # the server validates sampling params: a client error, not a failure
            return web.json_response({"error": "max_new_tokens must be >= 0"}, status=400)
        if body.get("stream"):
            return await stream(request, body)
        pieces, rank = [], 0
        async for piece_rank, piece in generate_tokens(state, body):
            pieces.append(piece)
            rank = piece_rank  # every piece comes from the request's one rank
        return web.json_response(full_json(request.path, "".join(pieces), rank, len(pieces)))

    async def stream(request: web.Request, body: dict) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Upstream-Name": state.name,
            }
        )
        await resp.prepare(request)
        text, n = "", max_tokens_of(body)
        async for rank, piece in generate_tokens(state, body):
            text += piece
            shown = (
                text if request.path == "/generate" else piece
            )  # /generate streams the text so far
            done = len(text.split()) == n
            await resp.write(
                b"data: "
                + json.dumps(chunk_json(request.path, shown, rank, done)).encode()
                + b"\n\n"
            )
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def loads(request: web.Request) -> web.Response:
        include = set(request.query.get("include", "all").split(","))
        if include - INCLUDE_NAMES:
            return web.json_response(
                {"error": f"unknown include {sorted(include - INCLUDE_NAMES)}"}, status=400
            )
        ranks = range(state.dp_size)
        if "dp_rank" in request.query:
            ranks = [int(request.query["dp_rank"])]
        if state.dead & set(ranks):
            return error(
                503, f"DP rank(s) {sorted(state.dead & set(ranks))} are not alive", retry_after=5
            )
        now = datetime.datetime.now(datetime.timezone.utc).isoformat()
        return web.json_response(
            {
                "timestamp": now,
                "version": "upstream-test",
                "loads": [state.rank_load(r) for r in ranks],
            }
        )

    async def get_load(request: web.Request) -> web.Response:
        out = []
        for r in range(state.dp_size):
            core = state.rank_load(r)
            out.append(
                {
                    "dp_rank": r,
                    "num_reqs": core["num_running_reqs"],
                    "num_waiting_reqs": 0,
                    "num_tokens": core["num_total_tokens"],
                }
            )
        return web.json_response(out)

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response(
            {"dp_size": state.dp_size, "model_path": "upstream", "version": "test"}
        )

    async def models(request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "upstream", "object": "model"}]}
        )

    async def health(request: web.Request) -> web.Response:
        if state.dead:
            return error(
                503, f"DP ranks alive: {[r not in state.dead for r in range(state.dp_size)]}"
            )
        return web.Response(text="OK")

    async def set_rank(request: web.Request) -> web.Response:
        rank, alive = int(request.query["rank"]), request.query.get("alive", "1") == "1"
        (state.dead.discard if alive else state.dead.add)(rank)
        return web.json_response({"dead": sorted(state.dead)})

    async def abort_request(request: web.Request) -> web.Response:
        state.aborts.append(await request.json())  # recorded only: the stand-in's requests run out
        return web.json_response({"aborted": 0})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "name": state.name,
                "by_rank": {str(k): v for k, v in state.by_rank.items()},
                "running": len(state.running),
                "completed": state.completed,
                "aborted": state.aborted,
                "shed": state.shed,
                "bodies": state.bodies[-50:],
                "aborts": state.aborts[-50:],
            }
        )

    @web.middleware
    async def api_key(request: web.Request, handler):
        open_path = request.path == "/health" or request.path.startswith("/_")
        if (
            state.api_key
            and not open_path
            and request.headers.get("Authorization") != f"Bearer {state.api_key}"
        ):
            return error(401, "missing or wrong API key")
        return await handler(request)

    @web.middleware
    async def name_header(request: web.Request, handler):
        resp = await handler(request)
        if not resp.prepared:  # streams set it before sending their head
            resp.headers["X-Upstream-Name"] = state.name  # lets a test see which server answered
        return resp

    app = web.Application(middlewares=[name_header, api_key])
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        app.router.add_post(path, infer)
    for path, handler in (
        ("/v1/loads", loads),
        ("/get_load", get_load),
        ("/server_info", server_info),
        ("/get_server_info", server_info),
        ("/v1/models", models),
        ("/health", health),
        ("/_stats", stats),
    ):
        app.router.add_get(path, handler)
    app.router.add_post("/_rank", set_rank)
    app.router.add_post("/abort_request", abort_request)
    return app


def error(status: int, message: str, retry_after: int | None = None) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.json_response(
        {"error": {"message": message, "code": status}}, status=status, headers=headers
    )


def refuse(state: State, body: dict) -> web.Response | None:
    """The real server's refusals: a dead rank, and load shedding when too many requests run."""
    rank = state.pick_rank(body)
    if rank in state.dead:
        return error(503, f"DP rank {rank} is not alive", retry_after=5)
    if state.max_concurrency and len(state.running) >= state.max_concurrency:
        state.shed += 1
        return error(
            503,
            f"rank {rank}: the waiting queue is full ({state.max_concurrency} requests)",
            retry_after=state.retry_after,
        )
    return None


async def main(args: argparse.Namespace) -> None:
    state = State(
        args.dp_size,
        args.token_delay,
        args.name,
        args.max_concurrency,
        args.retry_after,
        args.api_key or None,
    )
    runner = web.AppRunner(make_app(state), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port, reuse_address=True)
    await site.start()
    print(f"READY port={runner.addresses[0][1]}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--dp-size", type=int, default=1)
    parser.add_argument(
        "--token-delay", type=float, default=0.0, help="seconds per generated token"
    )
    parser.add_argument("--name", default="upstream")
    parser.add_argument(
        "--max-concurrency", type=int, default=0, help="shed beyond this many running (0: never)"
    )
    parser.add_argument("--retry-after", type=int, default=1, help="Retry-After of a shed request")
    parser.add_argument("--api-key", default="")
    try:
        asyncio.run(main(parser.parse_args()))
    except KeyboardInterrupt:
        sys.exit(0)
