"""The valid traffic of the soak (``benchmarks/bench_soak.py``): closed-loop streams, each sending one request after
another from a mix of kinds (native and OpenAI, streaming and not, structured output, ``n`` > 1, multi-turn chats,
sessions whose prompts extend the last prompt and its output token for token, so the prefix cache hits), and
checking each answer. A session's requests carry its routing key (``X-SMG-Routing-Key``), so a router with the
``consistent_hashing`` policy sends them to one rank, where the last turn is cached.

A failed request records why, and the DP rank its error names when a rank died under it (the server's message:
"DP rank N died: ..."), so the soak can tell the failures a killed rank caused from any other.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from tests.tools.hostile import sse_events

REQUEST_TIMEOUT_S = 120.0
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
}
REGEX = r"(yes|no), [0-9]{1,3}!"
TOOL = {
    "type": "function",
    "function": {
        "name": "set_light",
        "parameters": {
            "type": "object",
            "properties": {"room": {"enum": ["kitchen", "hall"]}, "on": {"type": "boolean"}},
            "required": ["room", "on"],
            "additionalProperties": False,
        },
    },
}
WORDS = (
    "alpha beta gamma delta kernel token batch cache queue rank model layer tensor stream".split()
)
SESSION_TURNS = 5
_RANK = re.compile(r"DP rank (\d+) died")


@dataclass
class Result:
    kind: str
    start: float  # seconds since the soak began
    end: float
    ok: bool
    status: int | None
    error: str = ""
    rank: int | None = None  # the DP rank a failure's error names as dead
    prompt_tokens: int = 0  # sessions: the prompt's tokens and those the prefix cache served
    cached_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Failure(Exception):
    def __init__(self, status: int | None, why: str) -> None:
        super().__init__(why)
        self.status = status


def system_prompts(count: int = 4, words: int = 150, seed: int = 0) -> list[str]:
    """Shared system prompts: every chat starts with one of them (prefix-cache hits across streams)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


class Stream:
    """One closed-loop client: ``run`` sends requests until ``stop`` is set, appending a Result for each."""

    def __init__(self, index: int, systems: list[str], began: float, results: list[Result]) -> None:
        self.rng = random.Random(index)
        self.system = systems[index % len(systems)]
        self.began = began
        self.results = results
        self.conversation: list[dict[str, str]] = []
        self.index = index
        self.session_ids: list[int] = []
        self.turns = 0
        self.sessions = 0
        self.cached = (0, 0)  # the last session turn's prompt tokens and cached tokens
        self.kinds: dict[str, Callable[[httpx.AsyncClient], Awaitable[None]]] = {
            "native_stream": self.native_stream,
            "native_batch": self.native_batch,
            "completion_n2": self.completion_n2,
            "chat_stream": self.chat_stream,
            "chat_json": self.chat_json,
            "regex": self.regex,
            "chat_history": self.chat_history,
            "session": self.session,
            "tool_call": self.tool_call,
        }

    async def run(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        names = list(self.kinds)
        while not stop.is_set():
            kind = self.rng.choice(names)
            start = time.monotonic() - self.began
            self.cached = (0, 0)
            try:
                await asyncio.wait_for(self.kinds[kind](client), REQUEST_TIMEOUT_S)
                result = Result(
                    kind, start, time.monotonic() - self.began, True, 200, "", None, *self.cached
                )
            except Exception as error:
                status = error.status if isinstance(error, Failure) else None
                why = (
                    str(error) if isinstance(error, Failure) else f"{type(error).__name__}: {error}"
                )
                rank = _RANK.search(why)
                result = Result(
                    kind,
                    start,
                    time.monotonic() - self.began,
                    False,
                    status,
                    why[:500],
                    int(rank.group(1)) if rank else None,
                )
            self.results.append(result)

    # ---- the kinds ---------------------------------------------------------------------------------------------
    async def native_stream(self, client: httpx.AsyncClient) -> None:
        body = {"text": self._prompt(), "stream": True, "sampling_params": self._sampling(16)}
        events = await _stream(client, "/generate", body)
        _check_native(events[-2])

    async def native_batch(self, client: httpx.AsyncClient) -> None:
        body = {"text": [self._prompt(), self._prompt()], "sampling_params": self._sampling(8)}
        answers = await _post(client, "/generate", body)
        if not isinstance(answers, list) or len(answers) != 2:
            raise Failure(200, f"not two answers: {str(answers)[:200]}")
        for answer in answers:
            _check_native(answer)

    async def completion_n2(self, client: httpx.AsyncClient) -> None:
        body = {
            "prompt": self._prompt(),
            "n": 2,
            "max_tokens": 12,
            "logprobs": 2,
            "seed": self._seed(),
        }
        choices = (await _post(client, "/v1/completions", body))["choices"]
        if len(choices) != 2 or not all(c["logprobs"]["tokens"] for c in choices):
            raise Failure(200, f"bad choices: {str(choices)[:200]}")

    async def chat_stream(self, client: httpx.AsyncClient) -> None:
        body = {"messages": self._messages(self._words(8)), "max_tokens": 16, "stream": True}
        events = await _stream(client, "/v1/chat/completions", body)
        finished = [c for e in events[:-1] for c in e["choices"] if c.get("finish_reason")]
        if len(finished) != 1:
            raise Failure(200, f"{len(finished)} finished choices")

    async def chat_json(self, client: httpx.AsyncClient) -> None:
        format_ = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
        body = {
            "messages": self._messages("Answer in JSON."),
            "response_format": format_,
            "max_tokens": 48,
            "seed": self._seed(),
            "chat_template_kwargs": {"enable_thinking": False},
        }
        choice = (await _post(client, "/v1/chat/completions", body))["choices"][0]
        if choice["finish_reason"] == "stop":
            answer = json.loads(choice["message"]["content"])
            if set(answer) != {"ok", "color"}:
                raise Failure(200, f"not the schema: {answer}")

    async def regex(self, client: httpx.AsyncClient) -> None:
        body = {"text": self._prompt(), "sampling_params": {**self._sampling(24), "regex": REGEX}}
        answer = await _post(client, "/generate", body)
        _check_native(answer)
        if answer["meta_info"]["finish_reason"]["type"] == "stop":
            if not re.fullmatch(REGEX, answer["text"]):
                raise Failure(200, f"{answer['text']!r} does not match")

    async def session(self, client: httpx.AsyncClient) -> None:
        """One turn of a session: the prompt is the last turn's prompt and output and 16 new tokens (prefix-cache
        hits, on the rank its routing key picks)."""
        if self.turns == SESSION_TURNS or not self.session_ids:
            self.session_ids = [self.rng.randrange(10, 4000) for _ in range(200)]
            self.turns = 0
            self.sessions += 1
        ids = self.session_ids + [self.rng.randrange(10, 4000) for _ in range(16)]
        body = {"input_ids": ids, "sampling_params": self._sampling(12)}
        headers = {"X-SMG-Routing-Key": f"stream-{self.index}-session-{self.sessions}"}
        answer = await _post(client, "/generate", body, headers)
        _check_native(answer)
        self.session_ids = ids + answer["output_ids"]
        self.turns += 1
        meta = answer["meta_info"]
        self.cached = (meta["prompt_tokens"], meta["cached_tokens"])

    async def chat_history(self, client: httpx.AsyncClient) -> None:
        """One turn of a multi-turn chat (the template renders the history)."""
        if len(self.conversation) >= 2 * SESSION_TURNS:
            self.conversation = []
        self.conversation.append({"role": "user", "content": self._words(12)})
        body = {
            "messages": [{"role": "system", "content": self.system}, *self.conversation],
            "max_tokens": 12,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        message = (await _post(client, "/v1/chat/completions", body))["choices"][0]["message"]
        self.conversation.append({"role": "assistant", "content": message["content"] or "ok"})

    async def tool_call(self, client: httpx.AsyncClient) -> None:
        body = {
            "messages": self._messages("Light, please."),
            "tools": [TOOL],
            "tool_choice": "required",
            "max_tokens": 60,
            "seed": self._seed(),
            "chat_template_kwargs": {"enable_thinking": False},
        }
        choice = (await _post(client, "/v1/chat/completions", body))["choices"][0]
        if choice["finish_reason"] == "tool_calls":
            call = choice["message"]["tool_calls"][0]["function"]
            if call["name"] != "set_light" or set(json.loads(call["arguments"])) != {"room", "on"}:
                raise Failure(200, f"a bad call: {call}")

    # ---- pieces ------------------------------------------------------------------------------------------------
    def _prompt(self) -> str:
        return f"{self.system}\n{self._words(10)}"

    def _messages(self, user: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": user}]

    def _words(self, count: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(count))

    def _seed(self) -> int:
        return self.rng.randrange(1 << 30)

    def _sampling(self, tokens: int) -> dict[str, Any]:
        return {"max_new_tokens": tokens, "temperature": 1.0, "seed": self._seed()}


async def _post(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> Any:
    response = await client.post(path, json=body, headers=headers)
    if response.status_code != 200:
        raise Failure(response.status_code, response.text[:500])
    return response.json()


async def _stream(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[Any]:
    """A stream's events, ``[DONE]`` last; an error event or a missing ``[DONE]`` is a Failure."""
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            raise Failure(
                response.status_code, (await response.aread())[:500].decode(errors="replace")
            )
        events = sse_events([line async for line in response.aiter_lines()])
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    if errors:
        raise Failure(200, f"error event: {json.dumps(errors[0])[:400]}")
    if len(events) < 2 or events[-1] != "[DONE]":
        raise Failure(200, f"the stream ended without [DONE]: {str(events[-2:])[:200]}")
    return events


def _check_native(answer: Any) -> None:
    reason = ((answer or {}).get("meta_info") or {}).get("finish_reason") or {}
    if reason.get("type") not in ("stop", "length") or not isinstance(answer.get("text"), str):
        raise Failure(200, f"not a finished answer: {str(answer)[:200]}")


async def run_traffic(
    base_url: str, streams: int, seconds: float, began: float, results: list[Result]
) -> None:
    """``streams`` closed-loop clients for ``seconds``; the requests in flight at the end are finished."""
    stop = asyncio.Event()
    systems = system_prompts()
    limits = httpx.Limits(max_connections=streams + 8)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=REQUEST_TIMEOUT_S, limits=limits
    ) as client:
        clients = [Stream(i, systems, began, results).run(client, stop) for i in range(streams)]
        tasks = [asyncio.create_task(c) for c in clients]
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*tasks)
