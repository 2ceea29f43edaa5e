from __future__ import annotations

import asyncio
import dataclasses
import json

from aiohttp import web

from sglang_lite.sim.traces import agentic_trace
from tests.tools.replay import PromptTokens, replay_closed_loop, replay_timestamps, summarize


async def _fake_server(log: list[tuple[str, int, int]]) -> web.AppRunner:
    """Streams `max_new_tokens` SSE chunks and records (session turn order, prompt length) per request."""

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = body["sampling_params"]["max_new_tokens"]
        log.append(("start", len(body["input_ids"]), n))
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(1, n + 1):
            await asyncio.sleep(0.001)
            await resp.write(
                f"data: {json.dumps({'meta_info': {'completion_tokens': i}})}\n\n".encode()
            )
        await resp.write(b"data: [DONE]\n\n")
        log.append(("end", len(body["input_ids"]), n))
        return resp

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def _url(runner: web.AppRunner) -> str:
    port = runner.addresses[0][1]
    return f"http://127.0.0.1:{port}"


def test_closed_loop_keeps_session_order_and_concurrency():
    trace = [
        dataclasses.replace(r, output_len=min(r.output_len, 5)) for r in agentic_trace(6, seed=2)
    ]  # fast

    async def run():
        log: list = []
        runner = await _fake_server(log)
        try:
            return log, await replay_closed_loop(_url(runner), trace, concurrency=2, vocab_size=100)
        finally:
            await runner.cleanup()

    log, results = asyncio.run(run())
    assert len(results) == len(trace) and all(r.ok for r in results)
    assert all(r.output_tokens == r.request.output_len for r in results)
    in_flight = peak = 0
    for kind, _, _ in log:
        in_flight += 1 if kind == "start" else -1
        peak = max(peak, in_flight)
    assert peak <= 2
    done_turns: dict[str, int] = {}
    for r in results:  # results are appended in completion order: turns of a session come in order
        assert done_turns.get(r.request.session, -1) == r.request.turn - 1
        done_turns[r.request.session] = r.request.turn
    assert summarize(results, 1.0)["failed"] == 0


def test_timestamp_replay_and_shared_prompts():
    trace = agentic_trace(3, seed=0, session_rate=50.0)[:4]
    prompts = PromptTokens(vocab_size=50)
    first, second = prompts.ids(trace[0]), prompts.ids(trace[1])
    assert (
        trace[1].session == trace[0].session and second[: len(first)] == first
    )  # turn 2 repeats turn 1's prompt
    assert all(10 <= t < 50 for t in second)

    async def run():
        log: list = []
        runner = await _fake_server(log)
        try:
            return await replay_timestamps(_url(runner), [trace[0]], vocab_size=50)
        finally:
            await runner.cleanup()

    (result,) = asyncio.run(run())
    assert result.ok and result.ttft <= result.latency
