"""NGRAM: prompt-lookup drafts, taken from the request's own prompt and output; no draft model, no forward.

The request's last ``n`` tokens (``n`` from the longest match window down to the shortest) are looked up among its
earlier tokens; at the latest earlier occurrence of the longest suffix that occurred, the tokens that followed it
are the drafts. Where the continuation runs into the present (a periodic output: the latest occurrence is the
previous period) it is copied with overlap, as an LZ77 match is, so a repeating output gets whole chains.
Each request keeps an index of the latest occurrence of every n-gram of its tokens (``NgramIndex``), extended by the
tokens each step appends: a lookup is a few dictionary reads, however long the request.

SGLang's NGRAM also shares a trie of n-grams across requests with tree-shaped drafts; here the drafts are one chain
from the request's own tokens (vLLM's ``ngram`` method), which is what the verify step takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_lite.scheduler.request import Req
from sglang_lite.scheduler.speculative.base import Drafter, Kept


class NgramIndex:
    """The latest occurrence, with a token after it, of every n-gram (``low <= n <= high``) of a growing
    sequence of tokens."""

    def __init__(self, low: int, high: int) -> None:
        self.low = low
        self.high = high
        self.tokens: list[int] = []
        self._ends: dict[
            tuple[int, ...], int
        ] = {}  # n-gram -> the end (exclusive) of its latest occurrence

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending here now have a token after them
            for n in range(self.low, min(self.high, end) + 1):
                self._ends[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def lookup(self, count: int) -> list[int]:
        """Up to ``count`` tokens continuing the sequence: what followed the latest earlier occurrence of its
        longest suffix that occurred before (none: [])."""
        size = len(self.tokens)
        for n in range(min(self.high, size), self.low - 1, -1):
            end = self._ends.get(tuple(self.tokens[size - n :]))
            if end is not None:
                return self._continue(end, count)
        return []

    def _continue(self, end: int, count: int) -> list[int]:
        out: list[int] = []
        size = len(self.tokens)
        for i in range(count):
            at = end + i
            out.append(self.tokens[at] if at < size else out[at - size])
        return out


@dataclass
class NgramDrafts:
    """A request's index of its own tokens and the drafts of its next step."""

    index: NgramIndex
    tokens: list[int] = field(default_factory=list)


class NgramDrafter(Drafter):
    def num_drafts(self, req: Req) -> int:
        return 0 if req.drafts is None else len(req.drafts.tokens)

    def propose(
        self, reqs: list[Req], counts: list[int], starts: list[int], slots: list[list[int]]
    ) -> list[list[int]]:
        return [r.drafts.tokens[: n - 1] if n > 1 else [] for r, n in zip(reqs, counts)]

    def after_prefill(self, kept: list[Kept]) -> None:
        for k in kept:
            self._look_up(k.req)

    after_verify = after_prefill  # new tokens either way: index them, look up the next drafts

    def _look_up(self, req: Req) -> None:
        """Indexes the request's tokens not indexed yet, then drafts its next step."""
        if req.drafts is None:
            low, high = self.context.config.ngram_window
            req.drafts = NgramDrafts(NgramIndex(low, high))
        drafts: NgramDrafts = req.drafts
        known = len(drafts.index.tokens)
        prompt = len(req.input_ids)
        if known < prompt:
            drafts.index.extend(req.input_ids[known:])
            known = prompt
        drafts.index.extend(req.output_ids[known - prompt :])
        drafts.tokens = drafts.index.lookup(self.context.config.speculative_steps)


DRAFTER = NgramDrafter
