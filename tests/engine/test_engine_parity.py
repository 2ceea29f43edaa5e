"""Greedy parity with transformers ``generate`` (each prompt alone) under continuous batching, chunked prefill,
late arrivals and retraction, on tiny random dense and MoE models."""

from __future__ import annotations

import threading

import pytest

from sglang_lite import Engine
from sglang_lite.runtime.factory import create_scheduler
from sglang_lite.server_args import ServerArgs
from tests.engine.conftest import random_prompts

LENGTHS = [3, 17, 40, 9, 33, 1]
NEW_TOKENS = 16
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
KINDS = ["moe", "dense"]


def small_chunks(path: str, **overrides) -> dict:
    args = dict(
        model_path=path, skip_tokenizer_init=True, chunked_prefill_size=8, max_prefill_tokens=16
    )
    return {**args, "max_total_tokens": 2048, "max_running_requests": 8, **overrides}


@pytest.mark.parametrize("kind", KINDS)
def test_scheduler_interleaved_arrivals_match_transformers(checkpoints, kind):
    """Requests join while others decode; prompts are prefilled in chunks of 8 inside 16-token batches."""
    checkpoint = checkpoints[kind]
    prompts = random_prompts(LENGTHS, seed=1)
    scheduler = create_scheduler(ServerArgs(**small_chunks(checkpoint.path)))
    outputs: dict[str, list[int]] = {}
    arrivals = {0: [0], 3: [1, 2], 9: [3], 10: [4, 5]}  # step -> prompts arriving before it
    step, seen_decode_with_waiting = 0, False
    while step < 10 or scheduler.has_work:
        for i in arrivals.get(step, []):
            scheduler.add_request(str(i), prompts[i], GREEDY)
        seen_decode_with_waiting |= bool(scheduler.queues.running and scheduler.queues.waiting)
        for out in scheduler.step():
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
        scheduler.check_invariants()
        step += 1
    assert seen_decode_with_waiting, "the arrivals must meet decoding requests"
    for i, prompt in enumerate(prompts):
        assert outputs[str(i)] == checkpoint.greedy(prompt, NEW_TOKENS), (
            f"prompt {i} (length {len(prompt)})"
        )
    assert scheduler.get_loads().num_used_tokens == 0


@pytest.mark.parametrize("kind", KINDS)
def test_engine_concurrent_requests_match_transformers(checkpoints, kind):
    checkpoint = checkpoints[kind]
    prompts = random_prompts(LENGTHS, seed=1)
    with Engine(**small_chunks(checkpoint.path)) as engine:
        stream = engine.generate_stream(input_ids=prompts[0], sampling_params=GREEDY)
        first = [next(stream)]  # prompt 0 is decoding
        late: dict = {}

        def generate_late() -> None:
            late.update(out=engine.generate(input_ids=prompts[1:], sampling_params=GREEDY))

        thread = threading.Thread(target=generate_late)
        thread.start()
        first += list(stream)
        thread.join(timeout=120)
        loads = engine.get_loads()
        engine.check_invariants()
    results = [[t for piece in first for t in piece["output_ids"]]] + [
        r["output_ids"] for r in late["out"]
    ]
    for i, (prompt, got) in enumerate(zip(prompts, results)):
        assert got == checkpoint.greedy(prompt, NEW_TOKENS), f"prompt {i} (length {len(prompt)})"
    meta = late["out"][0]["meta_info"]
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(prompts[1]), NEW_TOKENS)
    assert meta["finish_reason"] == {"type": "length", "length": NEW_TOKENS}
    assert (loads["num_used_tokens"], loads["num_running_reqs"], loads["num_waiting_reqs"]) == (
        0,
        0,
        0,
    )


@pytest.mark.parametrize(
    "kind,page_size", [("moe", 1), ("moe", ServerArgs.page_size), ("dense", ServerArgs.page_size)]
)
def test_small_pool_retracts_and_every_request_matches(checkpoints, kind, page_size):
    """80 KV tokens hold about two of these requests; admission reserves nothing, so decode must retract (a
    request whose last page is full needs a new page for its next token)."""
    checkpoint = checkpoints[kind]
    prompts = random_prompts(LENGTHS, seed=1)
    args = small_chunks(
        checkpoint.path,
        max_total_tokens=80,
        schedule_conservativeness=0.0,
        page_size=page_size,
    )
    with Engine(**args) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        loads = engine.get_loads()
        engine.check_invariants()
    retractions = loads["queues"]["num_retractions"]
    assert retractions > 0, "the pool was meant to run out"
    assert sum(r["meta_info"]["num_retractions"] for r in results) == retractions
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        assert result["output_ids"] == checkpoint.greedy(prompt, NEW_TOKENS), (
            f"prompt {i} (length {len(prompt)})"
        )
    assert (loads["num_used_tokens"], loads["num_running_reqs"], loads["num_waiting_reqs"]) == (
        0,
        0,
        0,
    )
