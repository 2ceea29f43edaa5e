"""Chat template renders held to bounds that stop them.

- Size: every message renders at least one token, so a conversation of more messages, content parts and tool calls
  than the context holds tokens can never fit; ``check_chat_size`` refuses it from the raw JSON, before pydantic
  builds a model per message or the template runs.
- Time: a render stops at its deadline. The template's Jinja sandbox looks the deadline up on every attribute,
  item and call it evaluates (``stop_at_deadline``) and raises ``RenderTimeout``, so the worker thread ends instead
  of rendering on after its request was answered.
- Room: renders run on threads of their own, never the default pool that tokenises text prompts. Conversations of
  more than ``LARGE_CHAT_ITEMS`` items take one thread with ``LARGE_RENDER_SLOTS`` places (beyond them a 503 with
  ``Retry-After``), so huge conversations wait on each other, not on the small ones everyone else sends.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any, TypeVar

from sglang_lite.server.io_struct import RequestError, bad_request

T = TypeVar("T")
logger = logging.getLogger(__name__)

CHAT_TEMPLATE_TIMEOUT_S = 10.0
LARGE_CHAT_ITEMS = 256  # messages, content parts and tool calls
# as many as asyncio's default pool: the tokenizer releases the GIL, so prompts tokenise in parallel
SMALL_RENDER_THREADS = min(32, (os.cpu_count() or 1) + 4)
LARGE_RENDER_SLOTS = 4  # large renders running or waiting
CANNOT_STOP = (
    "chat template renders cannot be stopped at their deadline (only their wait is bounded)"
)
# when the render running in this context must end (time.monotonic); None: no deadline
_deadline: ContextVar[float | None] = ContextVar("chat_render_deadline", default=None)


class RenderTimeout(Exception):
    """The chat template ran past its deadline."""


def chat_items(body: Any) -> int:
    """Messages, content parts and tool calls of a chat request's raw JSON (0 for a shape pydantic will refuse)."""
    messages = _messages(body)
    return len(messages) + sum(_parts(m) for m in messages if isinstance(m, dict))


def _messages(body: Any) -> list[Any]:
    messages = body.get("messages") if isinstance(body, dict) else None
    return messages if isinstance(messages, list) else []


def _parts(message: dict[str, Any]) -> int:
    content = message.get("content")
    calls = message.get("tool_calls")
    return (len(content) if isinstance(content, list) else 0) + (
        len(calls) if isinstance(calls, list) else 0
    )


def check_chat_size(body: Any, context_tokens: int) -> None:
    """A 400 naming ``messages`` for a conversation that renders more tokens than the context holds."""
    messages = len(_messages(body))
    # a list of too many messages is refused without counting its parts
    items = messages if messages > context_tokens else chat_items(body)
    if items > context_tokens:
        raise bad_request(
            f"messages: {items} messages, content parts and tool calls, more than the context length "
            f"({context_tokens} tokens) can hold (each renders at least one token)"
        )


# ---- the deadline inside the template ---------------------------------------------------------------------------
def stop_at_deadline(tokenizer: Any) -> bool:
    """Makes the Jinja environments of the tokenizer's chat templates check the render deadline; True if a render
    past its deadline now stops (checked with one)."""
    try:  # transformers' cache of compiled templates: private, so the probe below checks it still works
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        logger.warning(CANNOT_STOP)
        return False
    templates = getattr(tokenizer, "chat_template", None)
    texts = templates.values() if isinstance(templates, dict) else [templates]
    for text in (t for t in texts if isinstance(t, str)):
        _check_deadline_in(_compile_jinja_template(text).environment)
    try:
        _render_by(tokenizer, time.monotonic() - 1.0)
    except RenderTimeout:
        return True
    except Exception:  # noqa: BLE001 - a template that refuses the probe conversation proves nothing
        pass
    logger.warning(CANNOT_STOP)
    return False


def _check_deadline_in(environment: Any) -> None:
    if getattr(environment, "checks_render_deadline", False):
        return
    for name in ("getattr", "getitem", "call"):
        setattr(environment, name, _deadline_checked(getattr(environment, name)))
    environment.checks_render_deadline = True


def _deadline_checked(method: Callable[..., Any]) -> Callable[..., Any]:
    def checked(*args: Any, **kwargs: Any) -> Any:
        deadline = _deadline.get()
        if deadline is not None and time.monotonic() > deadline:
            raise RenderTimeout()
        return method(*args, **kwargs)

    return checked


def _render_by(tokenizer: Any, deadline: float) -> str:
    token = _deadline.set(deadline)
    try:
        probe = [{"role": "user", "content": "hi"}]
        return tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    finally:
        _deadline.reset(token)


def run_by_deadline(deadline: float, work: Callable[..., T], *args: Any) -> T:
    """Runs ``work`` on this thread with the render deadline set (a render inside it stops there)."""
    if (
        time.monotonic() > deadline
    ):  # its wait for a thread used up its time: the server's load, not the chat's
        raise RequestError(503, "the chat renderer is busy; retry later", {"Retry-After": "1"})
    token = _deadline.set(deadline)
    try:
        return work(*args)
    finally:
        _deadline.reset(token)


# ---- the threads ---------------------------------------------------------------------------------------------------
class RenderLanes:
    """Two pools of render threads: small conversations on ``SMALL_RENDER_THREADS``, large ones on one thread with
    ``LARGE_RENDER_SLOTS`` places."""

    def __init__(self, budget_s: float = CHAT_TEMPLATE_TIMEOUT_S) -> None:
        self.budget_s = budget_s
        self.small = ThreadPoolExecutor(SMALL_RENDER_THREADS, thread_name_prefix="chat-render")
        self.large = ThreadPoolExecutor(1, thread_name_prefix="chat-render-large")
        self.large_slots = threading.BoundedSemaphore(LARGE_RENDER_SLOTS)

    async def run(self, items: int, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` on a render thread within the budget (``RenderTimeout`` past it); a 503 when the large
        lane is full. A cancelled wait cancels work that has not started."""
        deadline = time.monotonic() + self.budget_s
        if items <= LARGE_CHAT_ITEMS:
            return await asyncio.wrap_future(
                self.small.submit(run_by_deadline, deadline, work, *args)
            )
        if not self.large_slots.acquire(blocking=False):
            raise RequestError(
                503,
                f"messages: {LARGE_RENDER_SLOTS} chats of more than {LARGE_CHAT_ITEMS} messages are already "
                "being rendered; retry later",
                {"Retry-After": "1"},
            )
        future = self.large.submit(run_by_deadline, deadline, work, *args)
        future.add_done_callback(lambda _: self.large_slots.release())
        return await asyncio.wrap_future(future)

    def shutdown(self) -> None:
        self.small.shutdown(wait=False, cancel_futures=True)
        self.large.shutdown(wait=False, cancel_futures=True)
