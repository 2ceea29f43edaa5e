"""The built-in tiny Qwen3.5-MoE assets load with stock transformers, offline, and behave like a Qwen tokenizer."""

from __future__ import annotations

import json
import os

os.environ.setdefault(
    "HF_HUB_OFFLINE", "1"
)  # before transformers is imported; local_files_only backs it up

import pytest
from transformers import AutoConfig, AutoTokenizer

from sglang_lite.assets import TINY_MODEL_DIR

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ROUND_TRIP_TEXTS = [
    "",
    "Hello, world!",
    "def f(x):\n\treturn x ** 2  # squares\r\n",
    "  leading and trailing spaces  ",
    "héllo wörld, ça va? Ünïcödé NFC: é",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🙂👍🏽 and ZWJ 👩‍👩‍👧 and flags 🇫🇷",
    "math ∑∫√∞ ≠ ≤ and arrows → ⇒",
    "\x00\x01 control \u200b zero-width \ufeff bom",
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def config():
    return AutoConfig.from_pretrained(TINY_MODEL_DIR, local_files_only=True)


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_encode_decode_round_trips(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < len(tokenizer) for i in ids)


def test_round_trip_keeps_special_tokens_in_text(tokenizer) -> None:
    text = "<|im_start|>user\nhi<|im_end|>\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_text_is_nfc_normalised_like_qwen(tokenizer) -> None:
    decomposed = "e\u0301"  # NFD form of "é"; Qwen's NFC normaliser composes it, so only NFC text round-trips exactly
    assert tokenizer.decode(tokenizer.encode(decomposed)) == "\u00e9"


def test_special_tokens_are_single_ids(tokenizer) -> None:
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in SPECIALS]
    assert all(len(i) == 1 for i in ids)
    assert len({i[0] for i in ids}) == len(SPECIALS)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token_id == ids[2][0] and tokenizer.pad_token_id == ids[0][0]


def test_plain_encode_adds_no_bos_or_eos(tokenizer) -> None:
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)


def test_chat_template_renders_chatml(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert (
        text == expected + "<think>\n"
    )  # Qwen3.5 thinks by default: the prompt opens the think block
    no_thinking = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert no_thinking == expected + "<think>\n\n</think>\n\n"
    assert not tokenizer.apply_chat_template(messages, tokenize=False).endswith(
        "<|im_start|>assistant\n"
    )


def test_chat_template_takes_text_parts(tokenizer) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>user\nab<|im_end|>\n"


def test_config_matches_tokenizer(config, tokenizer) -> None:
    assert config.vocab_size >= len(tokenizer)
    assert config.vocab_size % 64 == 0
    assert config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert config.pad_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert config.bos_token_id is None


def test_config_shape(config) -> None:
    assert type(config).__name__ == "Qwen3_5MoeTextConfig"
    assert config.architectures == ["Qwen3_5MoeForCausalLM"]
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    ) == (128, 4, 2, 32)
    assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
    assert config.rope_parameters["partial_rotary_factor"] == 0.25
    assert config.tie_word_embeddings is False


def test_generation_config_stops_on_both_eos(tokenizer) -> None:
    generation = json.loads((TINY_MODEL_DIR / "generation_config.json").read_text())
    expected = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    assert set(generation["eos_token_id"]) == expected


def test_package_data_glob_covers_assets() -> None:
    # setup.py ships package_data "assets/*/*": every asset must sit exactly one folder below assets/.
    package_root = TINY_MODEL_DIR.parents[1]
    shipped = set(package_root.glob("assets/*/*"))
    assert set(TINY_MODEL_DIR.iterdir()) <= shipped
    assert not any(p.is_dir() for p in TINY_MODEL_DIR.iterdir())
