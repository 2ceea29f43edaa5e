"""Bad input is a 4xx with a message, never a 5xx; an OpenAPI-driven fuzz run finds no 5xx either."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from tests.server.conftest import ServerProcess, wait_idle

LONG_TEXT = "word " * 1000  # ~1000 tokens, over the servers' 512-token context
HUGE_TEXT = "word " * 100_000  # over the characters any 512-token context can hold
CASES = [
    ("/generate", b"{not json", "json"),
    ("/generate", b"[1, 2]", "body"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ', "json"),
    (
        "/generate",
        b'{"text": "hi", "sampling_params": {"top_k": ' + b"9" * 5000 + b"}}",
        "body",
    ),  # json's digit cap
    ("/generate", {"sampling_params": {"max_new_tokens": 4}}, "exactly one of text and input_ids"),
    ("/generate", {"text": "hi", "input_ids": [1]}, "exactly one"),
    ("/generate", {"text": 5}, "text"),
    ("/generate", {"text": []}, "empty"),
    ("/generate", {"input_ids": []}, "input_ids"),
    ("/generate", {"input_ids": [1, 99999]}, "input_ids"),
    ("/generate", {"text": ""}, "input_ids"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "many"}}, "max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": 7}}, "stop"),
    ("/generate", {"text": "hi", "sampling_params": {"bogus_knob": 1}}, "bogus_knob"),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"frequency_penalty": 2.5}},
        "frequency_penalty",
    ),
    ("/generate", {"text": "hi", "sampling_params": [{}, {}]}, "entries"),
    ("/generate", {"text": "hi", "routed_dp_rank": 9}, "routed_dp_rank"),
    (
        "/generate",
        {"text": "hi", "return_logprob": True, "top_logprobs_num": -2},
        "top_logprobs_num",
    ),
    (
        "/generate",
        {"text": "hi", "return_logprob": True, "logprob_start_len": 50},
        "logprob_start_len",
    ),
    ("/generate", {"text": "hi", "top_logprobs_num": 2}, "return_logprob"),
    ("/generate", {"text": LONG_TEXT}, "context length"),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": []}, "empty"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": 0}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 101}, "logprobs"),
    ("/v1/completions", {"prompt": LONG_TEXT}, "context length"),
    ("/v1/completions", {"prompt": ["a", "b"], "stream": True}, "one prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": LONG_TEXT}]},
        "context length",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "assistant", "content": "x", "reasoning_content": HUGE_TEXT}],
        },
        "characters, more than the context length",  # counted before anything is tokenised
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"chat_template": "{% for i in range(10**9) %}x{% endfor %}"},
        },
        "chat_template_kwargs.chat_template",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"add_generation_prompt": False},
        },
        "chat_template_kwargs.add_generation_prompt",
    ),
    ("/abort_request", {"rid": 5}, "rid"),
    (
        "/generate",
        {"text": ["a"] * 1025},
        "text: 1025 prompts in one request",
    ),  # over --max-queued-requests
    ("/generate", {"input_ids": [[1]] * 1025}, "input_ids: 1025 prompts in one request"),
    ("/v1/completions", {"prompt": ["a"] * 1025}, "prompt: 1025 prompts in one request"),
]


# Values at and beyond every bound of docs/reliability.md (the servers' tiny model has a 4096-token vocabulary).
INF, NAN = float("inf"), float("nan")
VOCAB = 4096
BEYOND_INT64 = [2**63, 2**64, -(2**63) - 1]
CHAT = [{"role": "user", "content": "hi"}]


def _native(**params: object) -> dict:
    return {"text": "hi", "sampling_params": params}


HOSTILE = [
    *[
        ("/generate", _native(temperature=v, min_new_tokens=3), "temperature")
        for v in (INF, -INF, NAN)
    ],
    *[
        ("/generate", _native(**{name: v}), name)
        for name in ("top_p", "min_p")
        for v in (INF, NAN, -INF)
    ],
    *[
        ("/generate", _native(**{name: v}), name)
        for name in ("top_k", "max_new_tokens", "min_new_tokens", "seed")
        for v in BEYOND_INT64
    ],
    ("/generate", _native(top_k=VOCAB + 1), "top_k"),
    ("/generate", _native(max_new_tokens=2**31), "max_new_tokens"),
    ("/generate", _native(temperature=10**400), "temperature"),
    ("/generate", _native(stop=["s"] * 17), "stop"),
    ("/generate", _native(stop=[f"stop{i}" for i in range(5000)]), "stop"),
    ("/generate", _native(stop=["x" * 1025]), "stop"),
    ("/generate", _native(stop_token_ids=[VOCAB]), "stop_token_ids"),
    ("/generate", _native(stop_token_ids=[2**64]), "stop_token_ids"),
    ("/generate", _native(stop_token_ids=list(range(257))), "stop_token_ids"),
    ("/generate", _native(ignore_eos="yes"), "ignore_eos"),
    ("/generate", _native(n=NAN), "n"),
    ("/generate", _native(frequency_penalty=INF), "frequency_penalty"),
    ("/generate", {"text": "hi", "rid": "r" * 257}, "rid"),
    ("/generate", {"text": "a" * 2_000_000}, "text"),
    ("/generate", {"text": "lone \ud800 surrogate"}, "text"),
    ("/generate", _native(stop=["\udfff"]), "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ("/generate", {"text": ["hi", "a" * 2_000_000]}, "context length"),
    *[
        ("/v1/completions", {"prompt": "hi", name: v}, name)
        for name in ("temperature", "top_p", "min_p")
        for v in (INF, NAN)
    ],
    *[
        ("/v1/completions", {"prompt": "hi", name: v}, name)
        for name in ("max_tokens", "seed", "top_k", "min_tokens")
        for v in BEYOND_INT64
    ],
    ("/v1/completions", {"prompt": "hi", "top_k": VOCAB + 1}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "stop": ["s"] * 17}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": "x" * 1025}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "a" * 2_000_000}, "prompt"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": NAN}, "temperature"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "max_completion_tokens": 2**64},
        "max_completion_tokens",
    ),
    ("/v1/chat/completions", {"messages": CHAT, "seed": -(2**63) - 1}, "seed"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a" * 2_000_000}]},
        "messages",
    ),
]


def post_json(
    server: ServerProcess, path: str, body: object, timeout: float = 30
) -> httpx.Response:
    """Posts ``body`` as Python's json writes it: Infinity and NaN included, as a hostile client sends them."""
    return httpx.post(
        f"{server.url}{path}",
        content=json.dumps(body).encode(),
        timeout=timeout,
        headers={"content-type": "application/json", **server.headers},
    )


@pytest.mark.parametrize(
    "path,body,needle", HOSTILE, ids=[f"{i}-{c[0]}-{c[2]}" for i, c in enumerate(HOSTILE)]
)
def test_hostile_value_is_400_naming_the_field(
    server_dp1: ServerProcess, path: str, body: object, needle: str
) -> None:
    response = post_json(server_dp1, path, body)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert needle.lower() in message.lower(), message
    assert len(message) < 2000, "the error quotes a bounded part of the value"


def test_after_hostile_requests_nothing_is_registered_and_ranks_serve(
    server_dp2: ServerProcess,
) -> None:
    """Each refused request leaves no trace: its rid is free again, the ranks hold nothing, both still serve."""
    for path, body, _ in HOSTILE[::3]:
        if path == "/generate" and isinstance(body, dict) and "rid" not in body:
            body = {**body, "rid": "reused-rid"}
        assert post_json(server_dp2, path, body).status_code == 400
    normal = {
        "text": "hi",
        "rid": "reused-rid",
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
    }
    assert post_json(server_dp2, "/generate", normal).status_code == 200
    for rank in (0, 1):
        body = {"text": "hi", "routed_dp_rank": rank, "sampling_params": {"max_new_tokens": 2}}
        response = post_json(server_dp2, "/generate", body)
        assert (
            response.status_code == 200 and response.json()["meta_info"]["completion_tokens"] == 2
        )
    wait_idle(server_dp2)
    assert httpx.get(f"{server_dp2.url}/health").status_code == 200


@pytest.mark.parametrize(
    "path,body,needle", CASES, ids=[f"{i}-{c[0]}" for i, c in enumerate(CASES)]
)
def test_bad_request_is_4xx_with_message(
    server_dp1: ServerProcess, path: str, body: object, needle: str
) -> None:
    if isinstance(body, bytes):
        response = httpx.post(
            f"{server_dp1.url}{path}", content=body, headers={"content-type": "application/json"}
        )
    else:
        response = httpx.post(f"{server_dp1.url}{path}", json=body, timeout=30)
    assert 400 <= response.status_code < 500, response.text
    message = response.json()["error"]["message"]
    assert needle.lower() in message.lower(), message


def test_unknown_include_is_400(server_dp1: ServerProcess) -> None:
    response = httpx.get(f"{server_dp1.url}/v1/loads?include=everything")
    assert response.status_code == 400 and "everything" in response.json()["error"]["message"]


def test_router_reserialised_generate_body_is_accepted(server_dp1: ServerProcess) -> None:
    """The fields sglang-router 0.3.2 adds when it re-serialises a /generate body."""
    body = {
        "text": "hi",
        "model": None,
        "stream": False,
        "log_metrics": True,
        "return_hidden_states": False,
        "return_text_in_logprobs": False,
        "return_logprob": False,
        "data_parallel_rank": 0,
        "sampling_params": {
            "max_new_tokens": 3,
            "temperature": None,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "repetition_penalty": 1.0,
            "n": 1,
        },
    }
    response = httpx.post(f"{server_dp1.url}/generate", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["meta_info"]["completion_tokens"] == 3
    assert httpx.get(f"{server_dp1.url}/health").status_code == 200


def raw_http(server: ServerProcess, request: bytes) -> tuple[int, dict, bytes]:
    """Sends bytes as they are (no client would), returns (status, headers, body) of the answer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        conn.sendall(request)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in header_lines if ": " in line)
    return int(status_line.split()[1]), headers, body


@pytest.mark.parametrize(
    "content_length", [b"-5", b"ten", b"99999999999999999999999999999999999999999"]
)
def test_an_unparsable_or_absurd_content_length_gets_the_json_error_body(
    server_dp1: ServerProcess, content_length: bytes
) -> None:
    request = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: " + content_length
    status, headers, body = raw_http(server_dp1, request + b"\r\n\r\n{}")
    assert status in (400, 413) and headers["content-type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert error["code"] == status and error["type"] in ("BadRequestError", "RequestTooLarge")


def test_a_wrong_method_is_405_with_its_own_error_type(server_dp1: ServerProcess) -> None:
    response = httpx.get(f"{server_dp1.url}/generate", timeout=30)
    assert response.status_code == 405
    assert response.json()["error"]["type"] == "MethodNotAllowed"
