"""Bad input is a 4xx with a message, never a 5xx; an OpenAPI-driven fuzz run finds no 5xx either."""
from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import ServerProcess

LONG_TEXT = "word " * 1000  # ~1000 tokens, over the servers' 512-token context
CASES = [
    ("/generate", b"{not json", "json"),
    ("/generate", b"[1, 2]", "body"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ', "json"),
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
    ("/generate", {"text": "hi", "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
    ("/generate", {"text": "hi", "sampling_params": [{}, {}]}, "entries"),
    ("/generate", {"text": "hi", "routed_dp_rank": 9}, "routed_dp_rank"),
    ("/generate", {"text": "hi", "return_logprob": True}, "return_logprob"),
    ("/generate", {"text": LONG_TEXT}, "context length"),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": []}, "empty"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": 0}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "n": 3}, "n"),
    ("/v1/completions", {"prompt": LONG_TEXT}, "context length"),
    ("/v1/completions", {"prompt": ["a", "b"], "stream": True}, "one prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_TEXT}]}, "context length"),
    ("/abort_request", {"rid": 5}, "rid"),
]


@pytest.mark.parametrize("path,body,needle", CASES, ids=[f"{i}-{c[0]}" for i, c in enumerate(CASES)])
def test_bad_request_is_4xx_with_message(server_dp1: ServerProcess, path: str, body: object, needle: str) -> None:
    if isinstance(body, bytes):
        response = httpx.post(f"{server_dp1.url}{path}", content=body, headers={"content-type": "application/json"})
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
    body = {"text": "hi", "model": None, "stream": False, "log_metrics": True, "return_hidden_states": False,
            "return_text_in_logprobs": False, "return_logprob": False, "data_parallel_rank": 0,
            "sampling_params": {"max_new_tokens": 3, "temperature": None, "frequency_penalty": 0.0,
                                "presence_penalty": 0.0, "repetition_penalty": 1.0, "n": 1}}
    response = httpx.post(f"{server_dp1.url}/generate", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["meta_info"]["completion_tokens"] == 3
    assert httpx.get(f"{server_dp1.url}/health").status_code == 200
