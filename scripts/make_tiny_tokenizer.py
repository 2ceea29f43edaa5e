"""Build the tokenizer files of the built-in tiny Qwen3.5-MoE model (sglang_lite/assets/tiny_qwen3_5_moe/).

The tokenizer is a byte-level BPE in the Qwen2 layout (same pre-tokenizer regex, NFC normaliser, byte-level
decoder, special tokens after the learned vocabulary), trained on the source of the Python standard library:
a corpus every machine with Python has, so no download is needed. Files are read in sorted order and the corpus
is capped, so a given Python version always yields the same tokenizer, in a few seconds on two cores.

Run from the repository root:  python scripts/make_tiny_tokenizer.py
It writes tokenizer.json, tokenizer_config.json, special_tokens_map.json and generation_config.json; config.json
(the model shape) is kept by hand and only checked here against the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

ASSET_DIR = Path(__file__).resolve().parents[1] / "sglang_lite" / "assets" / "tiny_qwen3_5_moe"
VOCAB_SIZE = 4096  # learned tokens + specials; a multiple of 64 so config.json needs no padding
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
MODEL_MAX_LENGTH = 4096
MAX_FILE_BYTES = 64 * 1024  # keeps one huge module from dominating the corpus
MAX_CORPUS_BYTES = 6 * 1024 * 1024
SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}

# The pre-tokenizer split of Qwen2/Qwen3 tokenizers.
QWEN_SPLIT_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"  # noqa: E501

# Qwen3.5's chat format, written from its description: a system turn that lists the tools (JSON, one a line) and
# asks for the <tool_call><function=...><parameter=...> format; assistant turns after the last user query keep
# their reasoning in <think>; tool calls render from arguments objects; consecutive tool results share one user
# turn in <tool_response> blocks; the generation prompt opens <think> (thinking, the default) or renders an empty
# one (enable_thinking=false). Content is text or a list of text parts.
TOOL_INSTRUCTIONS = (
    "If you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n<tool_call>\\n"
    "<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n"
    "<parameter=example_parameter_2>\\nThis is the value for the second parameter\\nthat can span\\n"
    "multiple lines\\n</parameter>\\n</function>\\n</tool_call>\\n\\n<IMPORTANT>\\nReminder:\\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested "
    "within <tool_call></tool_call> XML tags\\n- Required parameters MUST be specified\\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function call, "
    "but NOT after\\n- If there is no function call available, answer the question like normal with your current "
    "knowledge and do not tell the user about function calls\\n</IMPORTANT>"
)
CHAT_TEMPLATE = (
    "{%- macro text(content) %}"
    "{%- if content is string %}{{- content }}"
    "{%- elif content is iterable and content is not mapping %}{%- for part in content %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}"
    "{%- endif %}"
    "{%- endmacro %}"
    "{%- set system = messages[0]['role'] == 'system' %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\n" + TOOL_INSTRUCTIONS + "' }}"
    "{%- if system and text(messages[0]['content']) | trim %}"
    "{{- '\\n\\n' + text(messages[0]['content']) | trim }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif system %}{{- '<|im_start|>system\\n' + text(messages[0]['content']) | trim + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.last_query = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = text(message['content']) | trim %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query %}"
    "{{- '<think>\\n' + (message['reasoning_content'] or '') | trim + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- content }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- set call = call['function'] if call['function'] is defined else call %}"
    "{%- if not loop.first or content %}{{- '\\n\\n' if loop.first else '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n<function=' + call['name'] + '>\\n' }}"
    "{%- for name, value in (call['arguments'] or {}) | items %}"
    "{{- '<parameter=' + name + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' }}"
    "{%- endfor %}"
    "{{- '</function>\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)


def corpus_files(root: Path) -> list[Path]:
    files = (p for p in root.rglob("*.py") if not SKIPPED_DIRS & set(p.relative_to(root).parts))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def corpus(root: Path, max_bytes: int = MAX_CORPUS_BYTES) -> Iterator[str]:
    total = 0
    for path in corpus_files(root):
        text = path.read_bytes()[:MAX_FILE_BYTES].decode("utf-8", errors="ignore")
        total += len(text.encode())
        if total > max_bytes:
            return
        yield text


def new_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train(root: Path) -> Tokenizer:
    tokenizer = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(root), trainer=trainer)
    # Added after training so that, as in Qwen, the specials take the last ids.
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, tokenizer.get_vocab_size()
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer) -> dict:
    added = {
        str(tokenizer.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "chat_template": CHAT_TEMPLATE,
    }


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def write_assets(tokenizer: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", tokenizer_config(tokenizer))
    special_map = {
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START, IM_END],
    }
    write_json(out / "special_tokens_map.json", special_map)
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    generation = {
        "eos_token_id": [ids[IM_END], ids[PAD_TOKEN]],
        "pad_token_id": ids[PAD_TOKEN],
        "bos_token_id": None,
    }
    write_json(out / "generation_config.json", generation)


def check_model_config(tokenizer: Tokenizer, out: Path) -> None:
    path = out / "config.json"
    if not path.exists():
        print(f"note: {path} is missing; it is kept by hand")
        return
    config = json.loads(path.read_text())
    assert config["vocab_size"] >= tokenizer.get_vocab_size(), (
        "config.json vocab_size is below the tokenizer's"
    )
    assert config["eos_token_id"] == tokenizer.token_to_id(IM_END), (
        "config.json eos_token_id is not <|im_end|>"
    )
    assert config["pad_token_id"] == tokenizer.token_to_id(PAD_TOKEN), (
        "config.json pad_token_id is not pad"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ASSET_DIR)
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    args = parser.parse_args()
    tokenizer = train(args.stdlib)
    write_assets(tokenizer, args.out)
    check_model_config(tokenizer, args.out)
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    print(f"wrote {args.out}: vocab {tokenizer.get_vocab_size()}, special ids {ids}")


if __name__ == "__main__":
    main()
