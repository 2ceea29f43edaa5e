"""What following a grammar may cost. xgrammar computes a request's token mask, and accepts its sampled token, on the
rank's step, so a grammar whose masks are slow holds up every request of the rank. Some grammars compile quickly
and then grow: ``(.*){1,32000}[bc]`` tracks more ways through its repetition with every token, and its mask takes
longer and longer (seconds within a few tokens).

- On a rank, ``MaskBudget`` times each mask and each accepted token of one request in the CPU time of the thread
  that runs it (a step the host preempted is not the grammar's cost); the first that takes longer than
  ``--grammar-mask-budget-ms`` fails the request with ``GrammarTooExpensive``, a 400. The operation that overruns
  runs to its end (xgrammar cannot be interrupted), so one slow operation is paid; since the cost grows token by
  token, the budget stops a growing grammar at its first token past the budget.
- Before a request reaches a rank, the HTTP side's checker processes follow the first tokens of each grammar they
  compile (``check_mask_cost``) and refuse it when a mask already overruns the budget.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

# tokens a checker process follows after a compile: a growing grammar overruns within a few
PROBE_TOKENS = 8
_PROBE_SEED = 0


class GrammarFault(ValueError):
    """The request's own grammar is at fault (a dead branch, masks too slow to follow): it fails alone, a 400."""


class GrammarTooExpensive(GrammarFault):
    """A mask or an accepted token of the request's grammar took longer than the budget."""


class MaskBudget:
    """The CPU time each operation on one grammar (a token mask, an accepted token) may take; None: no limit.
    ``subject`` names the grammar in the message. Once an operation overran, every later one raises at once without
    running: a batch whose sampling raised is sampled again row by row, and must not pay for a slow mask twice."""

    def __init__(self, budget_s: float | None, subject: str = "the request's grammar") -> None:
        self.budget_s = budget_s
        self.subject = subject
        self.overrun: str | None = None  # the message, once an operation overran

    @contextmanager
    def timed(self, what: str) -> Iterator[None]:
        """Runs the block (``what`` it does, for the message); raises GrammarTooExpensive past the budget."""
        if self.overrun is not None:
            raise GrammarTooExpensive(self.overrun)
        start = time.thread_time()
        yield
        spent = time.thread_time() - start
        if self.budget_s is not None and spent > self.budget_s:
            self.overrun = self._message(what, spent)
            raise GrammarTooExpensive(self.overrun)

    def _message(self, what: str, spent: float) -> str:
        return (
            f"{self.subject} is too expensive to follow: {what} took {spent * 1000:.0f} ms of CPU, more "
            f"than the {self.budget_s * 1000:g} ms a token may take (--grammar-mask-budget-ms); simplify "
            "the schema or grammar"
        )


def check_mask_cost(compiled: Any, kind: str, budget_s: float, tokens: int = PROBE_TOKENS) -> None:
    """Follows a compiled grammar for ``tokens`` tokens, each drawn (seeded) among those its mask allows, stop
    tokens aside; raises GrammarTooExpensive naming the field when a mask or an accepted token takes longer than
    ``budget_s`` of CPU: what a rank would meet at the request's first tokens."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(compiled)
    vocab = compiled.tokenizer_info.vocab_size
    stops = set(compiled.tokenizer_info.stop_token_ids)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    budget = MaskBudget(budget_s, subject=f"sampling parameter {kind}")
    draw = random.Random(_PROBE_SEED)
    for _ in range(tokens):
        with budget.timed("a token mask"):
            matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = [i for i in allowed_token_ids(bitmask[0], vocab) if i not in stops]
        if not allowed:
            return
        with budget.timed("accepting a token"):
            matcher.accept_token(draw.choice(allowed))


def allowed_token_ids(row: torch.Tensor, vocab: int) -> list[int]:
    """The token ids a bitmask row (int32 words, bit ``i % 32`` of word ``i // 32``) allows, below ``vocab``."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (row.unsqueeze(-1) >> shifts) & 1
    return bits.flatten()[:vocab].nonzero().flatten().tolist()
