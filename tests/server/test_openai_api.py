"""The official openai client against dp 1 and dp 2 servers; greedy text equals the offline engine's."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from sglang_lite.engine import Engine
from tests.server.conftest import ServerProcess

PROMPTS = ["The quick brown fox", "def fibonacci(n):"]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number."},
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine(
        None,
        load_format="dummy",
        context_length=512,
        max_total_tokens=8192,
        max_running_requests=16,
    ) as offline:
        yield offline


def greedy(engine: Engine, input_ids: list[int]) -> dict:
    return engine.generate(
        input_ids=input_ids, sampling_params={"max_new_tokens": MAX_TOKENS, "temperature": 0}
    )


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=server.api_key or "none", max_retries=0, timeout=60
    )


def test_models_lists_the_served_model(server: ServerProcess) -> None:
    models = client_of(server).models.list().data
    assert [m.id for m in models] == ["tiny_qwen3_5_moe"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_greedy_equals_engine(
    server: ServerProcess, engine: Engine, prompt: str
) -> None:
    expected = greedy(engine, engine.tokenizer.encode(prompt))
    result = client_of(server).completions.create(
        model="m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    assert result.choices[0].text == expected["text"]
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == MAX_TOKENS
    assert result.usage.prompt_tokens == expected["meta_info"]["prompt_tokens"]


def test_completion_stream_equals_engine(server: ServerProcess, engine: Engine) -> None:
    expected = greedy(engine, engine.tokenizer.encode(PROMPTS[0]))
    chunks = list(
        client_of(server).completions.create(
            model="m",
            prompt=PROMPTS[0],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_chat_greedy_and_stream_equal_engine(server: ServerProcess, engine: Engine) -> None:
    template = engine.tokenizer.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True
    )
    expected = greedy(engine, engine.tokenizer.encode(template, add_special_tokens=False))
    client = client_of(server)
    result = client.chat.completions.create(
        model="m", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert result.choices[0].message.content == expected["text"]
    assert result.choices[0].message.role == "assistant"
    assert result.usage.prompt_tokens == expected["meta_info"]["prompt_tokens"]
    chunks = list(
        client.chat.completions.create(
            model="m", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected["text"]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_native_generate_matches_engine_and_streams_cumulative_text(
    server: ServerProcess, engine: Engine
) -> None:
    ids = engine.tokenizer.encode(PROMPTS[1])
    expected = greedy(engine, ids)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}}
    result = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    assert result["output_ids"] == expected["output_ids"] and result["text"] == expected["text"]
    with httpx.stream(
        "POST", f"{server.url}/generate", json={**body, "stream": True}, timeout=60
    ) as response:
        events = [
            line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")
        ]
    assert events[-1] == "[DONE]"
    last = httpx.Response(200, content=events[-2]).json()
    assert last["text"] == expected["text"] and last["output_ids"] == expected["output_ids"]


def test_server_info_reports_dp_size(server: ServerProcess, request: pytest.FixtureRequest) -> None:
    info = httpx.get(f"{server.url}/server_info").json()
    assert info["dp_size"] == (2 if "dp2" in request.node.name else 1)
    assert httpx.get(f"{server.url}/get_server_info").json()["dp_size"] == info["dp_size"]
    assert "api_key" not in info
    plan = info[
        "alt_stream_plan"
    ]  # the model has sglang_lite.streams: its plan is reported; none overlaps on the CPU
    assert plan["platform"] == "cpu" and plan["decode_captured"]["alt_stream"] is False
    model = httpx.get(f"{server.url}/model_info").json()
    assert model["is_generation"] is True and model["model_type"] == "qwen3_5_moe_text"
