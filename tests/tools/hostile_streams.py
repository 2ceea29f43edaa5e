"""The hostile battery's rids, aborts and disconnects, n, log-probabilities and streaming."""

from __future__ import annotations

from tests.tools.hostile import ANSWERED, EITHER, Case
from tests.tools.hostile_checks import (
    completion_ok,
    native_ok,
    native_stream_ok,
    openai_stream_ok,
)
from tests.tools.hostile_requests import chat, completion, gen

UNICODE_RID = "hostile-\u00e9\U0001f600\u0000"


def rid_cases() -> list[Case]:
    long = {"max_new_tokens": 24, "ignore_eos": True}
    return [
        Case("an integer rid", "/generate", gen(rid=5)),
        Case("a 257-character rid", "/generate", gen(rid="r" * 257)),
        Case("an empty rid (as none)", "/generate", gen(rid=""), EITHER, check=native_ok()),
        Case("a rid list for one prompt", "/generate", gen(rid=["a", "b"])),
        Case(
            "the same rid for two prompts",
            "/generate",
            {"text": ["a", "b"], "rid": ["hostile-same", "hostile-same"]},
            rids=("hostile-same",),
        ),
        Case(
            "a rid for a batch of completions",
            "/v1/completions",
            completion(prompt=["a", "b"], rid="hostile-batch"),
            rids=("hostile-batch",),
        ),
        Case(
            "a unicode rid",
            "/generate",
            gen(rid=UNICODE_RID),
            ANSWERED,
            check=native_ok(),
            rids=(UNICODE_RID,),
        ),
        Case(
            "a rid clash",
            "/generate",
            {
                **gen({"max_new_tokens": 2000, "ignore_eos": True}, rid="hostile-clash"),
                "stream": True,
            },
            ANSWERED,
            action="rid_clash",
            rids=("hostile-clash",),
        ),
        Case(
            "n=2 with a rid",
            "/generate",
            gen({"n": 2}, rid="hostile-fork"),
            ANSWERED,
            check=native_ok(results=2),
            rids=("hostile-fork", "hostile-fork.n1"),
        ),
        Case(
            "abort an unknown rid",
            "/abort_request",
            {"rid": "hostile-nobody"},
            EITHER,
            check=lambda body: None,
        ),
        Case(
            "abort mid-stream",
            "/generate",
            {**gen(long, rid="hostile-abort"), "stream": True},
            ANSWERED,
            action="abort",
            rids=("hostile-abort",),
        ),
        Case(
            "hang up mid-stream",
            "/v1/chat/completions",
            chat(max_tokens=64, stream=True),
            ANSWERED,
            stream=True,
            action="disconnect",
        ),
        Case(
            "hang up before the answer",
            "/generate",
            gen({"max_new_tokens": 64, "ignore_eos": True}, rid="hostile-gone"),
            ANSWERED,
            action="disconnect",
            rids=("hostile-gone",),
        ),
    ]


def n_logprob_stream_cases() -> list[Case]:
    return [
        Case(
            "n=64, two tokens, streamed",
            "/v1/chat/completions",
            chat(n=64, max_tokens=2, stream=True),
            ANSWERED,
            stream=True,
            check=openai_stream_ok(choices=64),
        ),
        Case(
            "17 prompts x n=64",
            "/v1/completions",
            completion(prompt=["a"] * 17, n=64, max_tokens=1),
        ),
        Case(
            "echo, logprobs, n=3, max_tokens 0",
            "/v1/completions",
            completion(echo=True, logprobs=2, n=3, max_tokens=0),
            ANSWERED,
            check=completion_ok(n=3, logprobs=True),
        ),
        Case(
            "echo, top 100 logprobs, n=64 of a 400-token prompt",
            "/v1/completions",
            completion(prompt=list(range(1, 401)), echo=True, logprobs=100, n=64, max_tokens=0),
        ),
        Case(
            "top_logprobs 20, streamed",
            "/v1/chat/completions",
            chat(logprobs=True, top_logprobs=20, stream=True),
            ANSWERED,
            stream=True,
            check=openai_stream_ok(choices=1),
        ),
        Case("top_logprobs without logprobs", "/v1/chat/completions", chat(top_logprobs=3)),
        Case("logprobs 101", "/v1/completions", completion(logprobs=101)),
        Case(
            "256 token_ids_logprob from 0",
            "/generate",
            gen(
                return_logprob=True,
                logprob_start_len=0,
                top_logprobs_num=100,
                token_ids_logprob=list(range(256)),
            ),
            ANSWERED,
            check=native_ok(),
        ),
        Case(
            "logprob_start_len past the prompt",
            "/generate",
            gen(return_logprob=True, logprob_start_len=10_000),
        ),
        Case(
            "3 prompts x n=2",
            "/v1/completions",
            completion(prompt=["a", "b", "c"], n=2, max_tokens=2),
            ANSWERED,
            check=completion_ok(n=6),
        ),
        Case(
            "usage in a stream",
            "/v1/completions",
            completion(stream=True, stream_options={"include_usage": True}),
            ANSWERED,
            stream=True,
            check=openai_stream_ok(choices=1, usage=True),
        ),
        Case("a batched native stream", "/generate", {"text": ["a", "b"], "stream": True}),
        Case(
            "a streamed completion of 2 prompts",
            "/v1/completions",
            completion(prompt=["a", "b"], stream=True),
        ),
        Case(
            "a native stream with n=3",
            "/generate",
            {**gen({"n": 3}), "stream": True},
            ANSWERED,
            stream=True,
            check=native_stream_ok(results=3),
        ),
    ]
