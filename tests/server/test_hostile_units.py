"""The HTTP side's defences without a server: a request that fails while being dispatched leaves nothing
registered, tokenising never blocks the event loop, a too-long text is refused before the tokenizer runs, and the
concurrency limit answers 503 with Retry-After."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.sampling import SamplingParams
from sglang_lite.server.middleware import ConcurrencyLimitMiddleware
from sglang_lite.server.tokenizer_manager import GenerateInput, RequestError, TokenizerManager
from sglang_lite.server_args import ServerArgs

CONFIG = SchedulerConfig(
    max_total_tokens=8192,
    max_running_requests=4,
    context_length=512,
    chunk_size=256,
    max_prefill_tokens=1024,
    vocab_size=4096,
)


class SlowTokenizer:
    """Tokenises one id per character, slowly, holding its thread the way a long text does."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.calls = seconds, 0

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "abcd": 1}  # the longest token spans 4 characters

    def encode(self, text: str, **options: Any) -> list[int]:
        self.calls += 1
        time.sleep(self.seconds)
        return [1] * len(text)


class BrokenClient:
    def send(self, rank: int, message: Any) -> None:
        raise OverflowError("the transport cannot carry it")


def manager_with(tokenizer: Any = None, client: Any = None) -> TokenizerManager:
    manager = TokenizerManager(ServerArgs(dp_size=2))
    manager.config, manager.tokenizer, manager.client = CONFIG, tokenizer, client
    manager._pick_rank = lambda requested: (
        1
    )  # as if both ranks were up (their health is another test's concern)
    return manager


def test_a_request_that_fails_to_send_leaves_nothing_registered() -> None:
    async def run() -> None:
        manager = manager_with(client=BrokenClient())
        with pytest.raises(OverflowError):
            await manager.submit(GenerateInput("r1", [1, 2, 3], SamplingParams()))
        assert manager.streams == {} and manager.in_flight == [0, 0]

    asyncio.run(run())


def test_a_refused_request_leaves_nothing_registered() -> None:
    async def run() -> None:
        manager = manager_with(client=BrokenClient())
        for raw in (
            {"top_k": 2**63},
            {"temperature": float("inf")},
            {"seed": 2**64},
            {"stop": ["s"] * 17},
        ):
            with pytest.raises(RequestError) as refused:
                manager.sampling_params(raw)
            assert refused.value.status == 400 and next(iter(raw)) in refused.value.message
        with pytest.raises(RequestError, match="rid"):
            await manager.submit(GenerateInput("\ud800", [1], SamplingParams()))
        assert manager.streams == {} and manager.in_flight == [0, 0]

    asyncio.run(run())


def test_tokenising_does_not_stall_the_event_loop() -> None:
    async def run() -> None:
        manager = manager_with(SlowTokenizer(seconds=0.5))
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        assert await manager.encode("hello") == [1] * 5
        ticker.cancel()
        assert ticks >= 20, f"the loop ran only {ticks} ticks while a 0.5 s tokenisation ran"

    asyncio.run(run())


def test_a_text_too_long_for_the_context_is_refused_before_tokenising() -> None:
    async def run() -> None:
        tokenizer = SlowTokenizer(seconds=0.0)
        manager = manager_with(tokenizer)
        with pytest.raises(
            RequestError, match="prompt: the prompt has .* characters, more than the context length"
        ):
            await manager.encode("a" * (512 * 4 * 4 + 1), "prompt")
        with pytest.raises(RequestError, match="messages"):
            await manager.encode_chat([{"role": "user", "content": "a" * 10**6}], {})
        assert tokenizer.calls == 0
        assert (
            len(await manager.encode("a" * 2000)) == 2000
        )  # under the cheap bound: the tokenizer decides

    asyncio.run(run())


def test_concurrency_limit_answers_503_with_retry_after() -> None:
    async def run() -> None:
        release = asyncio.Event()

        async def slow_app(scope: dict, receive: Any, send: Any) -> None:
            await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        limited = ConcurrencyLimitMiddleware(slow_app, max_requests=2, exempt_paths=("/health",))
        statuses: list[tuple[int, dict]] = []

        async def call(path: str) -> None:
            async def send(message: dict) -> None:
                if message["type"] == "http.response.start":
                    statuses.append((message["status"], dict(message["headers"])))

            await limited(
                {"type": "http", "path": path, "method": "POST", "headers": []}, None, send
            )

        held = [asyncio.create_task(call("/generate")) for _ in range(2)]
        await asyncio.sleep(0.05)
        await call("/generate")  # over the limit: answered at once
        assert statuses == [(503, statuses[0][1])] and statuses[0][1][b"retry-after"] == b"1"
        health = asyncio.create_task(
            call("/health")
        )  # exempt: waits for the app like the held ones
        release.set()
        await asyncio.gather(*held, health)
        assert [s for s, _ in statuses[1:]] == [200, 200, 200] and limited.active == 0
        await call("/generate")
        assert statuses[-1][0] == 200

    asyncio.run(run())
