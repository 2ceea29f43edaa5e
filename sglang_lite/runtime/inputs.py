"""What both front ends accept as prompts: text (one string or a list) or token ids (one list or a list of lists),
and parameters given once for every prompt or as a list of one per prompt."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

# Unicode normalisation (NFC) can merge up to three characters into one before the tokenizer splits the text.
NORMALISATION_SLACK = 4


class Prompts(NamedTuple):
    """The prompts of one call (texts or token id lists), whether they are texts, and whether it was batched."""

    items: list[Any]
    is_text: bool
    batched: bool


def split_prompts(text: Any, input_ids: Any, text_name: str = "text") -> Prompts:
    """The prompts of a call that passes exactly one of a text and token ids; ValueError naming what is wrong."""
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
    return Prompts(prompts, text is not None, batched)


def prompt_token_ids(
    text: Any, input_ids: Any, encode: Callable[[str], list[int]], text_name: str = "text"
) -> tuple[list[list[int]], bool]:
    """Token ids of each prompt, and whether the call was batched; ValueError naming what is wrong."""
    prompts = split_prompts(text, input_ids, text_name)
    ids = [encode(t) for t in prompts.items] if prompts.is_text else prompts.items
    return ids, prompts.batched


def per_prompt(value: Any, n: int, name: str) -> list[Any]:
    """A parameter given once (the same for each of ``n`` prompts) or as a list of one per prompt, expanded to the
    list; ValueError naming ``name`` when the list has another length."""
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
    return value


def max_prompt_chars(tokenizer: Any, max_tokens: int) -> int:
    """A text longer than this cannot fit in ``max_tokens`` tokens, so it can be refused before tokenising: no
    token covers more bytes (byte-level vocabularies spell one byte per character) than its vocabulary entry."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return max_tokens * longest * NORMALISATION_SLACK
