"""The protocol between front ends and scheduler processes: every message survives the wire as itself, and a
frame that is not a message is refused with a clear error."""

from __future__ import annotations

import msgpack
import pytest

from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.protocol.outputs import ReqOutput, join_outputs
from sglang_lite.runtime import messages as m
from sglang_lite.runtime.inputs import prompt_token_ids
from sglang_lite.sampling.params import SamplingParams

CONFIG = SchedulerConfig(
    max_total_tokens=64,
    max_running_requests=2,
    context_length=32,
    chunk_size=8,
    max_prefill_tokens=16,
    vocab_size=100,
    eos_token_ids=(1, 2),
)
EVERY_MESSAGE = [
    m.AddRequest("r1", [5, 6], SamplingParams(max_new_tokens=3, stop=["\n"], seed=7)),
    m.AddRequest("r2", [5], SamplingParams(), stream=False),
    m.AbortRequest("r1"),
    m.LoadsQuery(3, ("core", "queues")),
    m.CheckQuery(4),
    m.Stop(),
    m.Ready(
        1, 4242, CONFIG, {"platform": "cuda", "auto_overlap_by_batch_size": {1: True, 8: False}}
    ),
    m.Ack(0, "r1", m.REFUSED, "sampling parameter top_p must be in (0, 1], got 2"),
    m.StepOutputs(
        1,
        [
            ReqOutput("r1", [9], "a", False, {"completion_tokens": 1}),
            ReqOutput("r2", [], "", True, {}),
        ],
    ),
    m.LoadsReply(0, 3, {"dp_rank": 0, "num_running_reqs": 1}),
    m.CheckReply(0, 4, None),
    m.Fatal(1, "RuntimeError: out of memory"),
]


@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=lambda message: message.kind)
def test_every_message_round_trips_with_its_types(message):
    back = m.decode(m.encode(message))
    assert back == message and type(back) is type(message)


def test_structured_fields_come_back_typed():
    ready = m.decode(m.encode(EVERY_MESSAGE[6]))
    assert ready.config.eos_token_ids == (1, 2)
    add = m.decode(m.encode(EVERY_MESSAGE[0]))
    assert isinstance(add.sampling_params, SamplingParams) and add.sampling_params.stop == ["\n"]


def test_a_frame_that_is_not_a_message_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown message kind 'Launch'"):
        m.decode(msgpack.packb(["Launch", 1]))
    with pytest.raises(ValueError, match="malformed Ack message"):
        m.decode(msgpack.packb(["Ack", 0]))


def test_join_outputs_keeps_every_token_and_the_last_meta():
    parts = [
        ReqOutput("r", [1], "a", False, {"n": 1}),
        ReqOutput("r", [2, 3], "bc", True, {"n": 3}),
    ]
    assert join_outputs(parts) == ReqOutput("r", [1, 2, 3], "abc", True, {"n": 3})


def test_prompts_are_text_or_ids_one_or_a_batch():
    encode = lambda text: [len(text)]  # noqa: E731
    assert prompt_token_ids("abc", None, encode) == ([[3]], False)
    assert prompt_token_ids(["a", "bb"], None, encode) == ([[1], [2]], True)
    assert prompt_token_ids(None, [4, 5], encode) == ([[4, 5]], False)
    assert prompt_token_ids(None, [[4], [5, 6]], encode) == ([[4], [5, 6]], True)
    with pytest.raises(ValueError, match="exactly one of prompt and input_ids"):
        prompt_token_ids("a", [1], encode, text_name="prompt")
    with pytest.raises(ValueError, match="the prompt list is empty"):
        prompt_token_ids([], None, encode)
