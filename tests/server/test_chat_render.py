"""Chat renders held to bounds that stop them (no server): a conversation of more messages and content parts than
the context holds tokens is a 400 naming ``messages`` before anything renders; a render past its deadline really
ends (its thread is free again), the event loop runs meanwhile, and huge conversations wait in a lane of their own
whose few places are answered 503 with Retry-After when full."""

from __future__ import annotations

import asyncio
import threading

import pytest
from transformers import AutoTokenizer

from sglang_lite.assets import TINY_MODEL_DIR
from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.server.chat_render import (
    LARGE_CHAT_ITEMS,
    LARGE_RENDER_SLOTS,
    RenderLanes,
    RenderTimeout,
    check_chat_size,
    stop_at_deadline,
)
from sglang_lite.server.input_processor import InputProcessor
from sglang_lite.server.io_struct import RequestError
from sglang_lite.server_args import ServerArgs

EMPTY = [{"role": "user", "content": ""}] * 200_000
BOUND_S = 30.0


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_MODEL_DIR, local_files_only=True)


def test_more_messages_and_parts_than_the_context_holds_are_refused() -> None:
    check_chat_size({"messages": [{"role": "user"}] * 512}, 512)
    with pytest.raises(
        RequestError, match=r"^messages: 200000 messages, .* \(512 tokens\)"
    ) as refused:
        check_chat_size({"messages": [{"role": "user"}] * 200_000}, 512)
    assert refused.value.status == 400
    parts = [{"type": "text", "text": ""}] * 600
    with pytest.raises(RequestError, match="messages: 601 messages, content parts and tool calls"):
        check_chat_size({"messages": [{"role": "user", "content": parts}]}, 512)
    check_chat_size({"messages": "not a list"}, 512)  # left to the body's validation


def test_a_render_past_its_deadline_stops_and_frees_its_thread(tokenizer) -> None:
    assert stop_at_deadline(tokenizer), "the template checks the deadline"

    async def run() -> None:
        lanes = RenderLanes(budget_s=0.2)
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        render = lanes.run(len(EMPTY), lambda: tokenizer.apply_chat_template(EMPTY, tokenize=False))
        with pytest.raises(RenderTimeout):  # raised in the render thread: its work has ended
            await asyncio.wait_for(render, BOUND_S)
        ticker.cancel()
        assert ticks >= 5, "the event loop ran while the render did"
        free = lanes.run(LARGE_CHAT_ITEMS + 1, lambda: "free")
        assert await asyncio.wait_for(free, BOUND_S) == "free", "the large lane's thread is free"
        lanes.shutdown()

    asyncio.run(run())


def test_renders_without_a_deadline_are_unchanged(tokenizer) -> None:
    stop_at_deadline(tokenizer)
    conversation = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert "hi" in text


def test_the_large_lane_answers_503_when_its_places_are_taken() -> None:
    async def run() -> None:
        lanes = RenderLanes()
        release = threading.Event()
        held = [
            asyncio.ensure_future(lanes.run(LARGE_CHAT_ITEMS + 1, release.wait, BOUND_S))
            for _ in range(LARGE_RENDER_SLOTS)
        ]
        await asyncio.sleep(0)
        with pytest.raises(RequestError) as busy:
            await lanes.run(LARGE_CHAT_ITEMS + 1, lambda: None)
        assert busy.value.status == 503 and busy.value.headers == {"Retry-After": "1"}
        assert await lanes.run(LARGE_CHAT_ITEMS, lambda: "small") == "small"  # its own lane
        release.set()
        assert await asyncio.wait_for(asyncio.gather(*held), BOUND_S) == [True] * len(held)
        assert await lanes.run(LARGE_CHAT_ITEMS + 1, lambda: "room again") == "room again"
        lanes.shutdown()

    asyncio.run(run())


def test_a_huge_chat_in_a_large_context_is_a_400_within_the_budget(tokenizer) -> None:
    """A context that holds 200,000 messages: the render itself must stop at its budget."""
    inputs = InputProcessor(ServerArgs())
    inputs.renders = RenderLanes(budget_s=0.3)
    inputs.tokenizer = tokenizer
    inputs.config = SchedulerConfig(
        max_total_tokens=1 << 20,
        max_running_requests=4,
        context_length=1 << 20,
        chunk_size=256,
        max_prefill_tokens=1024,
        vocab_size=4096,
    )
    inputs._prompt_chars_limit = 1 << 30  # only the render's budget can refuse it

    async def run() -> None:
        with pytest.raises(RequestError, match="messages: the chat template took more than 0.3 s"):
            await asyncio.wait_for(inputs.encode_chat(EMPTY, {}), BOUND_S)

    try:
        asyncio.run(run())
    finally:
        inputs.shutdown()


def test_a_render_that_waits_past_its_deadline_for_a_thread_is_a_503() -> None:
    async def run() -> None:
        lanes = RenderLanes(budget_s=0.2)
        release = threading.Event()
        held = asyncio.ensure_future(lanes.run(LARGE_CHAT_ITEMS + 1, release.wait, BOUND_S))
        queued = asyncio.ensure_future(lanes.run(LARGE_CHAT_ITEMS + 1, lambda: "late"))
        await asyncio.sleep(0.3)  # past the queued render's deadline before the thread is free
        release.set()
        with pytest.raises(RequestError) as busy:
            await asyncio.wait_for(queued, BOUND_S)
        assert busy.value.status == 503 and busy.value.headers == {"Retry-After": "1"}
        assert await asyncio.wait_for(held, BOUND_S) is True
        lanes.shutdown()

    asyncio.run(run())
