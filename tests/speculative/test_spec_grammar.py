"""Speculation on the built-in model's shape and tokenizer (random weights, an MTP head declared in a copy of its
config): requests with a grammar are not drafted for and keep their output; stop strings on real text."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from sglang_lite import assets
from tests.speculative.conftest import run_scheduler

REGEX = r"(yes|no), [0-9]{1,3}!"


@pytest.fixture(scope="module")
def builtin_with_head(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("builtin") / "model")
    shutil.copytree(assets.model_dir(None), path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["mtp_num_hidden_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def args(path: str, **extra):
    from sglang_lite.server_args import ServerArgs

    return ServerArgs(
        model_path=path,
        load_format="dummy",
        max_total_tokens=4096,
        max_running_requests=8,
        context_length=512,
        **extra,
    )


def test_grammar_requests_beside_drafted_ones(builtin_with_head):
    greedy = {"temperature": 0.0, "max_new_tokens": 24}
    prompt = list(range(100, 120))
    requests = [
        (prompt, {**greedy, "regex": REGEX}),
        (prompt, {**greedy, "ignore_eos": True}),
        (prompt[:7], {**greedy, "json_schema": json.dumps({"type": "boolean"})}),
    ]
    plain, plain_meta, _ = run_scheduler(args(builtin_with_head), requests)
    spec, metas, scheduler = run_scheduler(
        args(builtin_with_head, speculative_algorithm="NEXTN"), requests
    )
    assert spec == plain
    text = scheduler.tokenizer.decode(spec[0], skip_special_tokens=True)
    assert re.fullmatch(REGEX, text), text
    assert metas[0]["spec_accept_token_num"] == metas[2]["spec_accept_token_num"] == 0
    assert metas[1]["spec_verify_ct"] > 0
    assert [m["finish_reason"] for m in metas.values()] == [
        m["finish_reason"] for m in plain_meta.values()
    ]
