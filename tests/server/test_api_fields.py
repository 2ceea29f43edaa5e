"""Every request field of the OpenAI API (as the official client declares them) and of SGLang's /generate is
implemented or refused with a 400 naming it: none is accepted and silently ignored."""

from __future__ import annotations

import httpx
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from sglang_lite.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)
from tests.server.conftest import ServerProcess

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}
# a value each refused field may not take (its neutral values are accepted)
REFUSED_VALUES = {
    "store": True,
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low",
    "verbosity": "low",
    "web_search_options": {},
    "moderation": {"model": "x"},
    "suffix": "tail",
    "best_of": 3,
    "return_hidden_states": True,
    "input_embeds": [[0.1]],
    "image_data": "x.png",
    "audio_data": "x.wav",
    "video_data": "x.mp4",
    "lora_path": "adapter",
    "session_params": {"id": "s"},
    "custom_logit_processor": "processor",
}


def _declared(model: type) -> set[str]:
    """Implemented (a field of the model) or refused."""
    return {field.alias or name for name, field in model.model_fields.items()} | set(model.refused)


@pytest.mark.parametrize(
    "client_params, model",
    [
        (chat_params.CompletionCreateParamsBase, ChatCompletionRequest),
        (completion_params.CompletionCreateParamsBase, CompletionRequest),
    ],
    ids=["chat", "completions"],
)
def test_every_field_the_openai_client_sends_is_declared(client_params, model):
    """A field neither implemented nor refused would be ignored (extras are): each one the official client knows is
    one or the other."""
    missing = sorted(set(client_params.__annotations__) - _declared(model))
    assert not missing, f"{model.__name__} does not declare {missing}"
    assert "stream" in _declared(model)


@pytest.mark.parametrize(
    "model, body, path",
    [
        (ChatCompletionRequest, CHAT, "/v1/chat/completions"),
        (CompletionRequest, COMPLETION, "/v1/completions"),
        (GenerateRequest, {"text": "hi", "sampling_params": {"max_new_tokens": 2}}, "/generate"),
    ],
    ids=["chat", "completions", "generate"],
)
def test_refused_fields_are_a_400_naming_them_and_neutral_values_pass(
    server_dp1: ServerProcess, model, body, path
):
    assert set(model.refused) <= set(REFUSED_VALUES), "give each refused field a value to try"
    for name in model.refused:
        response = httpx.post(
            f"{server_dp1.url}{path}", json={**body, name: REFUSED_VALUES[name]}, timeout=30
        )
        assert response.status_code == 400, (name, response.text)
        assert name in response.json()["error"]["message"]
    neutral = {name: values[0] for name, (values, _) in model.refused.items()}
    assert (
        httpx.post(f"{server_dp1.url}{path}", json={**body, **neutral}, timeout=30).status_code
        == 200
    )


def test_sampling_parameters_outside_the_api_are_refused(server_dp1: ServerProcess):
    for params, name in [({"no_stop_trim": True}, "no_stop_trim"), ({"made_up": 1}, "made_up")]:
        response = httpx.post(
            f"{server_dp1.url}/generate", json={"text": "hi", "sampling_params": params}, timeout=30
        )
        assert response.status_code == 400 and name in response.json()["error"]["message"]
