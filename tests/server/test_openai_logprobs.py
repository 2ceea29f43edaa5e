"""Log-probabilities, echo, max_tokens 0 and n > 1 through the OpenAI endpoints (official client) and /generate:
the shapes clients read, streaming equal to non-streaming, and the same numbers on every route."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import ServerProcess

PROMPT_IDS = [11, 305, 42, 7, 1999, 64, 3]


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def native_logprobs(server: ServerProcess, **fields) -> dict:
    body = {"input_ids": PROMPT_IDS, "return_logprob": True, **fields}
    response = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["meta_info"]


def test_completion_echo_scores_the_prompt_like_generate(server_dp1: ServerProcess):
    """lm-evaluation-harness's log-likelihood request: echo, logprobs and max_tokens 0 (or 1)."""
    meta = native_logprobs(
        server_dp1, logprob_start_len=0, top_logprobs_num=3, sampling_params={"max_new_tokens": 0}
    )
    for max_tokens in (0, 1):
        choice = (
            client(server_dp1)
            .completions.create(
                model="m",
                prompt=PROMPT_IDS,
                echo=True,
                logprobs=3,
                max_tokens=max_tokens,
                temperature=0,
            )
            .choices[0]
        )
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(PROMPT_IDS) + max_tokens == len(logprobs.text_offset)
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert logprobs.token_logprobs[1 : len(PROMPT_IDS)] == [
            e[0] for e in meta["input_token_logprobs"][1:]
        ]
        assert choice.text.startswith("".join(logprobs.tokens[: len(PROMPT_IDS)]))
        for chosen, top, entries in zip(
            logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], meta["input_top_logprobs"][1:]
        ):
            assert max(top.values()) == entries[0][0] and chosen in top.values()
        if max_tokens:  # greedy: the generated token is the top one, exactly
            assert logprobs.token_logprobs[-1] == max(logprobs.top_logprobs[-1].values())
    assert meta["completion_tokens"] == 0


def test_every_choice_of_n_carries_the_prompt_logprobs_with_max_tokens_0(server_dp1: ServerProcess):
    """Parallel samples of a request that generates nothing are never forked; each still reports its prompt."""
    choices = (
        client(server_dp1)
        .completions.create(
            model="m", prompt=PROMPT_IDS, echo=True, logprobs=2, max_tokens=0, n=2, temperature=0
        )
        .choices
    )
    assert len(choices) == 2
    first, second = (c.logprobs for c in choices)
    assert len(first.tokens) == len(second.tokens) == len(PROMPT_IDS)
    assert first.token_logprobs == second.token_logprobs and first.token_logprobs[1] is not None


def test_chat_logprobs_and_top_logprobs_stream_as_they_return(server_dp1: ServerProcess):
    messages = [{"role": "user", "content": "Name a colour."}]
    args = dict(
        model="m", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    whole = client(server_dp1).chat.completions.create(**args).choices[0]
    content = whole.logprobs.content
    assert len(content) == 6 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.logprob == entry.top_logprobs[0].logprob for entry in content)  # greedy
    assert all(entry.bytes == list(entry.token.encode()) for entry in content)
    streamed = [
        entry
        for chunk in client(server_dp1).chat.completions.create(**args, stream=True)
        for choice in chunk.choices
        if choice.logprobs
        for entry in choice.logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_completion_stream_carries_logprobs_per_chunk(server_dp1: ServerProcess):
    args = dict(model="m", prompt=PROMPT_IDS, max_tokens=5, temperature=0, logprobs=1)
    whole = client(server_dp1).completions.create(**args).choices[0].logprobs
    chunks = [
        c.choices[0].logprobs
        for c in client(server_dp1).completions.create(**args, stream=True)
        if c.choices and c.choices[0].logprobs
    ]
    assert [t for c in chunks for t in c.token_logprobs] == whole.token_logprobs
    assert [o for c in chunks for o in c.text_offset] == whole.text_offset


def test_native_logprobs_with_texts_and_chosen_ids(server_dp1: ServerProcess):
    meta = native_logprobs(
        server_dp1,
        logprob_start_len=2,
        token_ids_logprob=[5, 6],
        return_text_in_logprobs=True,
        sampling_params={"max_new_tokens": 3, "temperature": 0},
    )
    assert len(meta["input_token_logprobs"]) == len(PROMPT_IDS) - 2
    assert [len(e) for e in meta["output_token_ids_logprobs"]] == [2, 2, 2]
    assert all(
        isinstance(e[2], str) for e in meta["output_token_logprobs"] + meta["input_token_logprobs"]
    )


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_share_one_prompt(server_dp1: ServerProcess, stream: bool):
    args = dict(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        temperature=1.0,
        seed=3,
        n=3,
        stream=stream,
    )
    if not stream:
        response = client(server_dp1).chat.completions.create(**args)
        texts = {c.index: c.message.content for c in response.choices}
        single = client(server_dp1).chat.completions.create(**{**args, "n": 1})
        assert response.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
        assert texts[0] == single.choices[0].message.content  # sample 0 uses the request's seed
    else:
        texts, finished = {}, set()
        for chunk in client(server_dp1).chat.completions.create(
            **args, stream_options={"include_usage": True}
        ):
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
                if choice.finish_reason:
                    finished.add(choice.index)
        assert finished == {0, 1, 2}
    assert sorted(texts) == [0, 1, 2] and len(set(texts.values())) > 1


def test_native_stream_interleaves_parallel_samples_by_index(server_dp1: ServerProcess):
    body = {
        "input_ids": PROMPT_IDS,
        "stream": True,
        "sampling_params": {
            "max_new_tokens": 5,
            "temperature": 1.0,
            "seed": 4,
            "n": 2,
            "ignore_eos": True,
        },
    }
    last: dict[int, dict] = {}
    with httpx.stream("POST", f"{server_dp1.url}/generate", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for event in map(json.loads, lines[:-1]):
        last[event["index"]] = event  # cumulative: the last event of a sample holds all of it
    assert sorted(last) == [0, 1] and all(len(e["output_ids"]) == 5 for e in last.values())
    whole = httpx.post(
        f"{server_dp1.url}/generate", json={**body, "stream": False}, timeout=60
    ).json()
    assert [r["output_ids"] for r in whole] == [last[0]["output_ids"], last[1]["output_ids"]]
