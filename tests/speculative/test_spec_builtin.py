"""Speculation on the built-in model: its shape and tokenizer with random weights (an MTP head declared in a copy
of its config), where requests with a grammar are not drafted for and keep their output; its trained weights with
a random head added, exact on Python text."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from sglang_lite import assets
from sglang_lite.server_args import ServerArgs
from sglang_lite.tokenizer import load_tokenizer
from tests.hf_checkpoints import add_mtp_head
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


def args(path: str, **extra) -> ServerArgs:
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
    # by request: the order requests finish in is the engine's (a grammar may still be compiling)
    assert [metas[i]["finish_reason"] for i in range(len(requests))] == [
        plain_meta[i]["finish_reason"] for i in range(len(requests))
    ]


def test_builtin_trained_model_with_an_added_head_stays_exact(tmp_path):
    """The built-in model's trained weights with a random MTP head written beside them, on Python text."""
    path = str(tmp_path / "model")
    shutil.copytree(assets.model_dir(None), path)
    add_mtp_head(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), path, seed=3)
    tokenizer = load_tokenizer(path)
    texts = ["def reverse_list(items):\n", "import os\n\n\nclass Config:\n    def __init__(self"]
    greedy = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    requests = [(tokenizer.encode(text), greedy) for text in texts]
    base = dict(model_path=path, max_total_tokens=4096, max_running_requests=4)
    plain, _, _ = run_scheduler(ServerArgs(**base), requests)
    spec, metas, _ = run_scheduler(ServerArgs(**base, speculative_algorithm="NEXTN"), requests)
    assert spec == plain
    assert all(m["spec_verify_ct"] > 0 for m in metas.values())


def test_the_shipped_head_drafts_held_out_python():
    """The built-in model's own MTP head (``scripts/train_tiny_model.py``) at ``--speculative-num-steps 3`` on
    Python in no corpus: the output is plain decoding's, and a verify step produces at least 1.6 tokens (accepted
    drafts plus the corrected one; issue 35's bound)."""
    from tests.models.test_trained_tiny_model import UNSEEN_PYTHON

    tokenizer = load_tokenizer(None)
    ids = tokenizer.encode(UNSEEN_PYTHON)
    greedy = {"temperature": 0.0, "max_new_tokens": 48, "ignore_eos": True}
    requests = [(ids[:cut], greedy) for cut in (12, 40, 90, 140)]
    base = dict(max_total_tokens=4096, max_running_requests=4)
    plain, _, _ = run_scheduler(ServerArgs(**base), requests)
    spec, metas, _ = run_scheduler(
        ServerArgs(**base, speculative_algorithm="NEXTN", speculative_num_steps=3), requests
    )
    assert spec == plain
    produced = sum(len(tokens) - 1 for tokens in spec.values())  # the first comes from the prefill
    verify_steps = sum(m["spec_verify_ct"] for m in metas.values())
    assert produced / verify_steps >= 1.6, (produced, verify_steps)
