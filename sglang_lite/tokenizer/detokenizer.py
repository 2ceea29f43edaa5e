"""Incremental detokenisation: text appears token by token and never ends inside a UTF-8 character.

Byte-level BPE tokens may each hold part of a character; decoding a growing window and holding back text that
ends in U+FFFD (an unfinished character) keeps every emitted piece valid. Decoding from a small window before the
newest tokens (``prefix_offset``) keeps the tokenizer's merge of spaces and prefixes the same as a full decode.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"


def _fast_decoder(tokenizer: Any) -> Any:
    """The Rust tokenizer behind a transformers fast tokenizer when decoding through it gives the same text (no
    ``_decode`` override, no space clean-up), else None. A call costs a fraction of the wrapper's, and with two calls
    per token per request the wrapper was a visible part of each decode step (docs/performance.md)."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    if (
        not isinstance(tokenizer, TokenizersBackend)
        or type(tokenizer)._decode is not TokenizersBackend._decode
    ):
        return None
    return None if tokenizer.clean_up_tokenization_spaces else tokenizer.backend_tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self._decoder = _fast_decoder(tokenizer) or tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = 0  # tokens before this are already emitted as text

    def push(self, token_ids: list[int]) -> str:
        """Adds tokens; returns the text they complete (possibly empty while a character is unfinished)."""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end: whatever is still held back, even an unfinished character."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return (
            self._decoder.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""
        )


class StopStringMatcher:
    """Finds stop strings across text pieces and holds back a tail that may still become one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = list(stops)
        self.pending = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Returns the text safe to emit; after a match, the text before it (the stop string is not emitted)."""
        self.pending += text
        hit = self._first_match()
        if hit is not None:
            position, self.matched = hit
            emit, self.pending = self.pending[:position], ""
            return emit
        keep = self._held_tail_len()
        emit, self.pending = (
            self.pending[: len(self.pending) - keep],
            self.pending[len(self.pending) - keep :],
        )
        return emit

    def flush(self) -> str:
        emit, self.pending = self.pending, ""
        return emit

    def _first_match(self) -> tuple[int, str] | None:
        hits = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        return min(hits) if hits else None

    def _held_tail_len(self) -> int:
        """Length of the longest tail of ``pending`` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(stop[:n]):
                    best = n
                    break
        return best
