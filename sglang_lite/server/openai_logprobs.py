"""Log-probabilities in the OpenAI shapes, from the entries a rank reports in ``meta_info`` (``[logprob, id, _]``).

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``. Completions (the legacy shape that
lm-evaluation-harness reads): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, where each
``top_logprobs`` entry maps a token's text to its log-probability, holding the top ``logprobs`` tokens and the
chosen one; with ``echo`` the prompt's tokens come first (the first has no log-probability).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

TokenTexts = Callable[[list[int]], list[str]]


def chat_logprobs(meta: dict[str, Any], texts: TokenTexts) -> dict[str, Any]:
    chosen = meta.get("output_token_logprobs", [])
    tops = meta.get("output_top_logprobs") or [[] for _ in chosen]
    chosen_texts = texts([entry[1] for entry in chosen])
    content = []
    for entry, text, top in zip(chosen, chosen_texts, tops):
        top_texts = texts([t[1] for t in top])
        content.append(
            {
                **_chat_entry(text, entry[0]),
                "top_logprobs": [_chat_entry(t, e[0]) for t, e in zip(top_texts, top)],
            }
        )
    return {"content": content}


def _chat_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


class CompletionLogprobs:
    """One choice's completions-shaped log-probabilities, built piece by piece (a stream) or at once; text
    offsets run on across pieces."""

    def __init__(self, texts: TokenTexts, echo: bool) -> None:
        self.texts = texts
        self.echo = echo
        self.offset = 0

    def piece(self, meta: dict[str, Any]) -> dict[str, Any]:
        chosen, tops = [], []
        if self.echo and "input_token_logprobs" in meta:
            chosen += meta["input_token_logprobs"]
            tops += meta.get("input_top_logprobs") or [None] * len(meta["input_token_logprobs"])
        output = meta.get("output_token_logprobs", [])
        chosen += output
        tops += meta.get("output_top_logprobs") or [[] for _ in output]
        tokens = self.texts([entry[1] for entry in chosen])
        shaped = {
            "tokens": tokens,
            "token_logprobs": [entry[0] for entry in chosen],
            "top_logprobs": [],
            "text_offset": [],
        }
        for entry, text, top in zip(chosen, tokens, tops):
            shaped["text_offset"].append(self.offset)
            self.offset += len(text)
            shaped["top_logprobs"].append(
                None if entry[0] is None else self._top(entry, text, top or [])
            )
        return shaped

    def _top(self, entry: list, text: str, top: list) -> dict[str, float]:
        ranked: dict[str, float] = {}
        for top_text, top_entry in zip(self.texts([e[1] for e in top]), top):
            ranked.setdefault(
                top_text, top_entry[0]
            )  # tokens of equal text: the likeliest (they come ranked)
        ranked.setdefault(text, entry[0])  # the chosen token is always there
        return ranked
