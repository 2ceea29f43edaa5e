"""The offline Engine on the built-in tiny model: streaming, stop strings, abort, bad requests, shutdown."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

from sglang_lite import Engine, assets

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    # the built-in model's folder as a pathlib.Path: the Engine takes any os.PathLike
    with Engine(
        pathlib.Path(assets.model_dir(None)),
        load_format="dummy",
        max_total_tokens=1024,
        max_running_requests=4,
        context_length=256,
    ) as engine:
        yield engine


def test_stream_pieces_add_up_to_the_blocking_result(engine):
    params = {**GREEDY, "max_new_tokens": 24}
    whole = engine.generate("def main():\n    print(", params)
    pieces = list(engine.generate_stream("def main():\n    print(", params))
    assert "".join(p["text"] for p in pieces) == whole["text"] and whole["text"]
    assert [t for p in pieces for t in p["output_ids"]] == whole["output_ids"]
    assert engine.tokenizer.decode(whole["output_ids"]) == whole["text"]
    assert [p["meta_info"]["finish_reason"] for p in pieces[:-1]] == [None] * (len(pieces) - 1)
    assert pieces[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 24}


def test_stop_string_trims_the_text(engine):
    whole = engine.generate("import sys\n", {**GREEDY, "max_new_tokens": 32})
    text = whole["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    result = engine.generate("import sys\n", {**GREEDY, "max_new_tokens": 32, "stop": stop})
    assert result["text"] == text[: text.index(stop)]
    assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert result["output_ids"] == whole["output_ids"][: len(result["output_ids"])]


def test_batch_of_prompts_with_per_request_params(engine):
    results = engine.generate(
        ["a = 1", "b = 2"], [{**GREEDY, "max_new_tokens": 3}, {**GREEDY, "max_new_tokens": 5}]
    )
    assert [r["meta_info"]["completion_tokens"] for r in results] == [3, 5]
    seeded_params = {"max_new_tokens": 8, "temperature": 1.0, "seed": 11}
    seeded = [engine.generate("x", seeded_params)["output_ids"] for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_abort_mid_decode_frees_kv_and_state(engine):
    stream = engine.generate_stream("while True:", {**GREEDY, "max_new_tokens": 200})
    first = [next(stream) for _ in range(3)]
    held = engine.get_loads()
    assert held["num_running_reqs"] == 1 and held["num_used_tokens"] > 0
    engine.abort(first[0]["meta_info"]["id"])
    loads = engine.get_loads()
    assert (loads["num_running_reqs"], loads["num_waiting_reqs"], loads["num_used_tokens"]) == (
        0,
        0,
        0,
    )
    engine.check_invariants()  # state slots and request rows are free too
    rest = list(stream)
    assert rest[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert rest[-1]["meta_info"]["completion_tokens"] < 200


def test_closing_a_stream_early_aborts_it(engine):
    stream = engine.generate_stream("for i in range(10):", {**GREEDY, "max_new_tokens": 200})
    next(stream)
    stream.close()
    assert engine.get_loads()["num_used_tokens"] == 0


@pytest.mark.parametrize(
    "params,field",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -5}, "top_k"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
    ],
)
def test_bad_params_raise_naming_the_field_while_others_run(engine, params, field):
    stream = engine.generate_stream("x = [", {**GREEDY, "max_new_tokens": 20})
    first = next(stream)
    with pytest.raises(ValueError, match=field):
        engine.generate(["ok", "bad"], [GREEDY, {**GREEDY, **params}])
    rest = list(stream)
    assert first["meta_info"]["completion_tokens"] + sum(len(p["output_ids"]) for p in rest) == 20
    assert rest[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert engine.get_loads()["num_waiting_reqs"] == 0


def test_prompt_longer_than_the_context_is_rejected(engine):
    with pytest.raises(ValueError, match="input_ids.*context length"):
        engine.generate(input_ids=list(range(300)), sampling_params=GREEDY)
    assert engine.generate(
        input_ids=list(range(10)), sampling_params={**GREEDY, "max_new_tokens": 2}
    )["output_ids"]


def test_shutdown_releases_and_refuses_new_work():
    engine = Engine(
        load_format="dummy", max_total_tokens=256, max_running_requests=2, skip_tokenizer_init=True
    )
    assert (
        engine.generate(input_ids=[1, 2, 3], sampling_params={**GREEDY, "max_new_tokens": 2})[
            "text"
        ]
        == ""
    )
    engine.shutdown()
    engine.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(input_ids=[1, 2, 3])


def test_a_dead_scheduler_process_fails_its_requests_with_a_clear_error():
    engine = Engine(
        load_format="dummy", max_total_tokens=256, max_running_requests=2, skip_tokenizer_init=True
    )
    try:
        stream = engine.generate_stream(
            input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 200}
        )
        next(stream)
        engine._client.core.processes[0].kill()
        with pytest.raises(RuntimeError, match="scheduler process died"):
            list(stream)
        with pytest.raises(RuntimeError, match="shut down"):
            engine.generate(input_ids=[1, 2, 3])
    finally:
        engine.shutdown()


def test_a_script_without_a_main_guard_can_build_an_engine():
    """The scheduler process is a fresh interpreter: it never re-imports the caller's __main__."""
    script = (
        "from sglang_lite import Engine\n"
        "engine = Engine(load_format='dummy', max_total_tokens=256, max_running_requests=2, skip_tokenizer_init=True)\n"
        "print(len(engine.generate(input_ids=[1, 2, 3], sampling_params={'max_new_tokens': 3})['output_ids']))\n"
        "engine.shutdown()\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "script.py")
        with open(path, "w") as f:
            f.write(script)
        done = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "3"
