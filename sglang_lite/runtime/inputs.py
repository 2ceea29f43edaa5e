"""What both front ends accept as prompts: text (one string or a list) or token ids (one list or a list of lists)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


def prompt_token_ids(text: Any, input_ids: Any, encode: Callable[[str], list[int]],
                     text_name: str = "text") -> tuple[list[list[int]], bool]:
    """Token ids of each prompt, and whether the call was batched; ValueError naming what is wrong."""
    if (text is None) == (input_ids is None):
        raise ValueError(f"pass exactly one of {text_name} and input_ids")
    if text is not None:
        batched = isinstance(text, list)
        prompts = [encode(t) for t in (text if batched else [text])]
    else:
        batched = bool(input_ids) and isinstance(input_ids[0], list)
        prompts = [list(x) for x in input_ids] if batched else [list(input_ids)]
    if batched and not prompts:
        raise ValueError("the prompt list is empty")
    return prompts, batched
