"""The hostile battery's requests that attack the HTTP layer and the sampling parameters: bodies, fields,
sampling parameters, logit_bias, stop strings, unicode (grammars, chat templates and tools are in
``hostile_grammars.py``; rids, aborts, disconnects, n, log-probabilities and streaming in ``hostile_streams.py``).
They fit a server with a context of 512 tokens or more and a vocabulary of at least 4096 tokens (the built-in
model), with or without the Qwen3.5 parsers: a case whose answer depends on those is an ``EITHER`` with a check
of the answer's shape."""

from __future__ import annotations

import json
from typing import Any

from tests.tools.hostile import ANSWERED, EITHER, Case
from tests.tools.hostile_checks import (
    chat_ok,
    completion_ok,
    native_ok,
)

CHAT = [{"role": "user", "content": "hi"}]
HUGE_TEXT = "word " * 400_000  # 2 MB: more characters than any context here holds
OPTIONAL_PROPERTIES = 2000
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def gen(params: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 4, **(params or {})}, **extra}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": CHAT, "max_tokens": 4, **extra}


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hi", "max_tokens": 4, **extra}


def raw_request(head: str, body: bytes = b"") -> bytes:
    return head.replace("\n", "\r\n").encode() + b"\r\n\r\n" + body


def wide_schema() -> str:
    """~54 KB of JSON schema (under the 64 KB limit): 2000 optional properties, whose grammar xgrammar builds in
    time that grows with their square (minutes), past any compile budget."""
    properties = {f"p{i}": {"type": "integer"} for i in range(OPTIONAL_PROPERTIES)}
    return json.dumps({"type": "object", "properties": properties}, separators=(",", ":"))


def body_cases() -> list[Case]:
    return [
        Case("invalid JSON", "/generate", b"{not json"),
        Case("invalid UTF-8 in JSON", "/generate", b'{"text": "\xff\xfe\xfd"}'),
        Case("a JSON array body", "/generate", [1, 2]),
        Case("a JSON null body", "/generate", b"null"),
        Case("an empty body", "/generate", b""),
        Case(
            "nesting 100k deep", "/generate", b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        ),
        Case("a 5000-digit number", "/generate", b'{"text": "hi", "rid": ' + b"9" * 5000 + b"}"),
        Case("NaN and Infinity literals", "/generate", gen({"temperature": float("nan")})),
        Case("a body over 16 MiB", "/generate", {"text": "a" * (17 << 20)}),
        Case(
            "duplicate keys (the last wins)",
            "/generate",
            b'{"text": "a", "text": "hi", "sampling_params": {"max_new_tokens": 4}}',
            ANSWERED,
            check=native_ok(),
        ),
        Case("a wrong method", "/generate", None, method="GET"),
        Case("an unknown path", "/v2/generate", gen()),
        Case(
            "text/plain content type",
            "/generate",
            gen(),
            EITHER,
            headers={"content-type": "text/plain"},
            check=native_ok(),
        ),
        Case(
            "a claimed gzip body",
            "/generate",
            gen(),
            EITHER,
            headers={"content-encoding": "gzip"},
            check=native_ok(),
        ),
        Case(
            "a negative Content-Length",
            "/generate",
            raw_request(
                "POST /generate HTTP/1.1\nHost: x\nContent-Length: -5\nConnection: close", b"{}"
            ),
            action="raw",
        ),
        Case(
            "an absurd Content-Length",
            "/generate",
            raw_request(
                "POST /generate HTTP/1.1\nHost: x\nContent-Length: "
                + "9" * 40
                + "\nConnection: close",
                b"{}",
            ),
            action="raw",
        ),
        Case(
            "a header line 100 KB long",
            "/generate",
            raw_request(
                "POST /generate HTTP/1.1\nHost: x\nX-Junk: "
                + "j" * 100_000
                + "\nContent-Length: 2\nConnection: close",
                b"{}",
            ),
            EITHER,
            action="raw",
        ),
        Case(
            "a slow body (slowloris)",
            "/generate",
            gen(),
            ANSWERED,
            action="slow_body",
            check=native_ok(),
        ),
        Case("a body shorter than its Content-Length", "/generate", gen(), action="truncated"),
        Case("an idle connection", "/generate", None, action="idle"),
    ]


def field_cases() -> list[Case]:
    return [
        Case("text as an object", "/generate", {"text": {"a": 1}}),
        Case("text and input_ids", "/generate", {"text": "hi", "input_ids": [1]}),
        Case("negative token ids", "/generate", {"input_ids": [1, -2]}),
        Case("token ids past the vocabulary", "/generate", {"input_ids": [1, 10**9]}),
        Case("float token ids", "/generate", {"input_ids": [1.5, 2]}),
        Case(
            "ragged input_ids batch",
            "/generate",
            {"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 2}},
            ANSWERED,
            check=native_ok(results=2),
        ),
        Case(
            "sampling_params list of the wrong length",
            "/generate",
            {"text": ["a", "b"], "sampling_params": [{}]},
        ),
        Case("routed_dp_rank out of range", "/generate", gen(routed_dp_rank=7)),
        Case("negative routed_dp_rank", "/generate", gen(routed_dp_rank=-1)),
        Case("stream as a string", "/generate", gen(stream="yes")),
        Case(
            "a huge model name",
            "/v1/completions",
            completion(model="m" * 100_000),
            EITHER,
            check=completion_ok(),
        ),
        Case("messages not a list", "/v1/chat/completions", {"messages": "hi"}),
        Case(
            "an unknown role",
            "/v1/chat/completions",
            {"messages": [{"role": "wizard", "content": "hi"}]},
        ),
        Case(
            "an image part",
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
        ),
        Case("suffix (refused field)", "/v1/completions", completion(suffix="tail")),
    ]


def sampling_cases(vocab: int) -> list[Case]:
    return [
        Case("temperature as text", "/generate", gen({"temperature": "hot"})),
        Case("top_k zero", "/generate", gen({"top_k": 0})),
        Case("top_p zero", "/v1/completions", completion(top_p=0)),
        Case("n over 64", "/v1/completions", completion(n=65)),
        Case("seed as text", "/generate", gen({"seed": "x"})),
        Case("repetition_penalty zero", "/generate", gen({"repetition_penalty": 0})),
        Case("an unknown sampling key", "/generate", gen({"mirostat": 2})),
        Case("no_stop_trim true", "/generate", gen({"no_stop_trim": True})),
        Case(
            "max_new_tokens 0",
            "/generate",
            gen({"max_new_tokens": 0}),
            ANSWERED,
            check=native_ok(tokens=0),
        ),
        Case(
            "min above max tokens",
            "/generate",
            gen({"min_new_tokens": 50, "max_new_tokens": 3}),
            ANSWERED,
            check=native_ok(),
        ),
        Case(
            "extreme but valid sampling",
            "/generate",
            gen({"temperature": 1e4, "top_p": 1e-9, "min_p": 1.0, "top_k": 1, "seed": -(2**63)}),
            ANSWERED,
            check=native_ok(),
        ),
        Case(
            "logit_bias of 100k keys",
            "/v1/completions",
            completion(logit_bias={str(i): 1 for i in range(100_000)}),
        ),
        Case("logit_bias key not an id", "/v1/completions", completion(logit_bias={"abc": 1})),
        Case("logit_bias key with a space", "/generate", gen({"logit_bias": {" 5": 1}})),
        Case("logit_bias of 1e9", "/generate", gen({"logit_bias": {"5": 1e9}})),
        Case(
            "logit_bias -100 on every token",
            "/generate",
            gen({"logit_bias": {str(i): -100 for i in range(vocab)}}),
            ANSWERED,
            check=native_ok(),
        ),
        Case(
            "logit_bias +100 on eos-like tokens",
            "/v1/completions",
            completion(logit_bias={str(vocab - i): 100 for i in range(1, 4)}),
            ANSWERED,
            check=completion_ok(),
        ),
        Case("an empty stop string", "/generate", gen({"stop": [""]})),
        Case("a stop string that is not text", "/generate", gen({"stop": ["a", 5]})),
        Case(
            "16 stop strings of 64 characters",
            "/generate",
            gen({"stop": [chr(0x4E00 + i) * 64 for i in range(16)]}),
            ANSWERED,
            check=native_ok(),
        ),
        Case("negative stop_token_ids", "/generate", gen({"stop_token_ids": [-1]})),
        Case(
            "an emoji stop string",
            "/v1/completions",
            completion(stop=["\U0001f600", "\u200b"]),
            ANSWERED,
            check=completion_ok(),
        ),
    ]


def unicode_cases() -> list[Case]:
    return [
        Case("a lone surrogate prompt", "/generate", {"text": "a\ud800b"}),
        Case("a lone surrogate stop", "/v1/completions", completion(stop=["\udfff"])),
        Case(
            "NUL, RTL, zero-width and emoji text",
            "/generate",
            {
                "text": "a\u0000b\u202ec\u200d\U0001f469\u200d\U0001f4bb",
                "sampling_params": {"max_new_tokens": 3},
            },
            ANSWERED,
            check=native_ok(),
        ),
        Case(
            "10k combining marks",
            "/v1/chat/completions",
            chat(messages=[{"role": "user", "content": "e" + "\u0301" * 10_000}]),
            EITHER,
            check=chat_ok(),
        ),
        Case("a 2 MB prompt", "/v1/completions", completion(prompt=HUGE_TEXT)),
    ]


def edge_cases() -> list[Case]:
    """Connections held or abused (over a raw socket, ``hostile_sockets.py``) and chats too large to render."""
    return [
        Case("slowloris headers (a byte every 0.5 s)", "/generate", gen(), action="slow_headers"),
        Case("a body stalled half-way", "/generate", gen(), action="stalled_body"),
        Case(
            "Content-Length and Transfer-Encoding, a request smuggled after the chunked body",
            "/generate",
            action="smuggle",
        ),
        Case(
            "a request beside 300 idle connections",
            "/generate",
            gen(),
            ANSWERED,
            action="idle_flood",
            check=native_ok(),
        ),
        Case(
            "200,000 messages without content",
            "/v1/chat/completions",
            chat(messages=[{"role": "user"}] * 200_000),
        ),
        Case(
            "200,000 messages of empty content",
            "/v1/chat/completions",
            chat(messages=[{"role": "user", "content": ""}] * 200_000),
        ),
        Case(
            "200,000 empty content parts",
            "/v1/chat/completions",
            chat(messages=[{"role": "user", "content": [{"type": "text", "text": ""}] * 200_000}]),
        ),
    ]
