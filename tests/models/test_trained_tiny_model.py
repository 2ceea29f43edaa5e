"""The built-in tiny model ships weights trained on the Python standard library (scripts/train_tiny_model.py):
they load by default, they predict unseen Python far better than random weights, and our model classes decode
them token for token as transformers does."""

from __future__ import annotations

import json

import pytest
import torch

from sglang_lite import load_model
from sglang_lite.assets import TINY_MODEL_DIR
from sglang_lite.generate import greedy_generate
from sglang_lite.tokenizer.hf_tokenizer import load_tokenizer

# Python written for this test, in no corpus.
UNSEEN_PYTHON = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals and return them sorted."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key, amount=1):
        self.counts[key] = self.counts.get(key, 0) + amount
        return self.counts[key]
'''
LOSS_BOUND = 3.5  # nats per token; random weights: about ln(4096) = 8.3


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def trained():
    return load_model(None)


def next_token_loss(model: torch.nn.Module, ids: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0, :-1]
    return torch.nn.functional.cross_entropy(logits.float(), torch.tensor(ids[1:])).item()


def test_the_shipped_weights_predict_unseen_python(trained, tokenizer):
    ids = tokenizer.encode(UNSEEN_PYTHON)
    assert next_token_loss(trained, ids) < LOSS_BOUND
    assert (
        next_token_loss(load_model(None, load_format="dummy"), ids) > 7.0
    )  # the same shape, random weights


def test_the_recorded_held_out_loss_is_below_the_bound():
    record = json.loads((TINY_MODEL_DIR / "training.json").read_text())
    assert record["final_heldout_loss"] < LOSS_BOUND


def test_a_greedy_completion_of_a_function_header_looks_like_python(trained, tokenizer):
    prompt = tokenizer.encode("def read_config(path):\n")
    text = tokenizer.decode(greedy_generate(trained, prompt, max_new_tokens=32))
    assert text.startswith("    ") and "\n" in text, repr(text)
    assert "return" in text or "(" in text, repr(text)


def test_greedy_decoding_matches_transformers_on_the_shipped_weights(trained, tokenizer):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()
    for text in ("class Stack:\n", "import os\n\n\ndef main():\n"):
        prompt = tokenizer.encode(text)
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = reference.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        expected = out[0, len(prompt) :].tolist()
        ours = greedy_generate(
            trained, prompt, max_new_tokens=24
        )  # stops early only at an end-of-sequence token
        assert ours == expected[: len(ours)]
        assert len(ours) == 24 or ours[-1] in trained.config.eos_token_ids


def test_a_chat_request_for_a_function_is_answered_with_python(trained, tokenizer):
    """The README's first chat request, through the model's chat template (thinking on, as the server renders
    it by default): the reply closes its thinking and answers with a Python function."""
    messages = [{"role": "user", "content": "Write a function that reverses a list."}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = greedy_generate(trained, tokenizer.encode(prompt), max_new_tokens=96)
    reasoning, closed, answer = tokenizer.decode(out).partition("</think>")
    assert closed, reasoning
    assert answer.lstrip().startswith("```python\ndef "), answer
