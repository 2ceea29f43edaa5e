"""What both front ends accept as prompts: text (one string or a list) or token ids (one list or a list of lists)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Unicode normalisation (NFC) can merge up to three characters into one before the tokenizer splits the text.
NORMALISATION_SLACK = 4


def split_prompts(
    text: Any, input_ids: Any, text_name: str = "text"
) -> tuple[list[Any], bool, bool]:
    """The prompts (texts or token id lists), whether they are texts, and whether the call was batched."""
    if (text is None) == (input_ids is None):
        raise ValueError(f"pass exactly one of {text_name} and input_ids")
    if text is not None:
        batched = isinstance(text, list)
        prompts = list(text) if batched else [text]
    else:
        batched = bool(input_ids) and isinstance(input_ids[0], list)
        prompts = [list(x) for x in input_ids] if batched else [list(input_ids)]
    if batched and not prompts:
        raise ValueError("the prompt list is empty")
    return prompts, text is not None, batched


def prompt_token_ids(
    text: Any, input_ids: Any, encode: Callable[[str], list[int]], text_name: str = "text"
) -> tuple[list[list[int]], bool]:
    """Token ids of each prompt, and whether the call was batched; ValueError naming what is wrong."""
    prompts, is_text, batched = split_prompts(text, input_ids, text_name)
    return ([encode(t) for t in prompts] if is_text else prompts), batched


def max_prompt_chars(tokenizer: Any, max_tokens: int) -> int:
    """A text longer than this cannot fit in ``max_tokens`` tokens, so it can be refused before tokenising: no
    token covers more bytes (byte-level vocabularies spell one byte per character) than its vocabulary entry."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return max_tokens * longest * NORMALISATION_SLACK
