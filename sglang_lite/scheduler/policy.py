"""Admission policy, pure: which waiting requests join the next prefill batch and how many tokens each runs.

Admission reserves KV for the decode tokens requests will still produce, scaled by ``new_token_ratio`` (not every
request runs to max_new_tokens). The ratio starts high, decays while decoding goes well, and jumps back up after
a retraction, so an over-committed pool corrects itself. Nothing here touches clocks, pools or torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, TypeVar


class PolicyRequest(Protocol):
    """What admission reads of a request: the scheduler's ``Req`` and the simulator's requests both have it."""

    @property
    def arrival_time(self) -> float: ...

    @property
    def num_to_compute(self) -> int: ...

    @property
    def remaining_new_tokens(self) -> int: ...


Req = TypeVar("Req", bound=PolicyRequest)


def order_waiting(waiting: list[Req], policy: str) -> list[Req]:
    """fcfs: by arrival (a retracted request keeps its place); sjf: shortest uncached prompt first."""
    if policy == "fcfs":
        return sorted(waiting, key=lambda r: r.arrival_time)
    if policy == "sjf":
        return sorted(waiting, key=lambda r: (r.num_to_compute, r.arrival_time))
    raise ValueError(f"unknown schedule policy {policy!r}")


def reserved_decode_tokens(req: PolicyRequest, ratio: float) -> int:
    return math.ceil(req.remaining_new_tokens * ratio)


def page_tokens(tokens: int, page_size: int) -> int:
    """The KV slots ``tokens`` new positions may take: whole pages (a request's pages are its own)."""
    return -(-tokens // page_size) * page_size


@dataclass(frozen=True)
class PrefillBudget:
    kv_free: int  # free KV slots now (whole pages)
    admit_free: int  # free KV slots minus what running and chunked requests are expected to need
    batch_tokens: int  # max tokens in one prefill forward
    chunk_size: int  # max tokens of one request in one forward
    free_rows: int  # request rows (and state slots) free
    new_token_ratio: float
    page_size: int = 1  # KV slots come in pages: a request's prompt takes whole pages


def plan_prefill(
    chunked: Req | None, waiting: list[Req], budget: PrefillBudget
) -> list[tuple[Req, int]]:
    """[(request, tokens to run now)]: the chunked request first, then waiting ones in order until a limit.

    At most one request ends partially prefilled (it becomes the next chunked request), so nothing follows it.
    """
    plan: list[tuple[Req, int]] = []
    tokens_left = budget.batch_tokens
    if chunked is not None:
        n = min(chunked.num_to_compute, budget.chunk_size, tokens_left, budget.kv_free)
        if n <= 0 or n < chunked.num_to_compute:
            return [(chunked, n)] if n > 0 else []
        plan.append((chunked, n))
        tokens_left -= n
    plan.extend(_admit_waiting(waiting, budget, tokens_left))
    return plan


def _admit_waiting(
    waiting: list[Req], budget: PrefillBudget, tokens_left: int
) -> list[tuple[Req, int]]:
    # admit_free already excludes what the chunked request still needs, so its chunk is not subtracted again
    admitted: list[tuple[Req, int]] = []
    admit_free = budget.admit_free
    rows = budget.free_rows
    for req in waiting:
        prompt = page_tokens(req.num_to_compute, budget.page_size)
        cost = prompt + reserved_decode_tokens(req, budget.new_token_ratio)
        if rows == 0 or tokens_left == 0 or cost > admit_free:
            break
        n = min(req.num_to_compute, budget.chunk_size, tokens_left)
        admitted.append((req, n))
        rows -= 1
        tokens_left -= n
        admit_free -= cost
        if n < req.num_to_compute:
            break
    return admitted


# Prefix-cache snapshots of long prompts: the chunk that would finish a prompt stops at the last multiple of
# SNAPSHOT_ALIGN before its last token when that point is at least SNAPSHOT_MIN_PREFIX tokens in and at least
# SNAPSHOT_MIN_GAIN past the previous snapshot. A chat template renders the end of a prompt (the generation prompt,
# e.g. "<think>\n") differently once the turn is history, so the next turn diverges a few tokens before the
# prompt's end, where no snapshot would otherwise be. The price is one more (short) forward for the prompt's tail:
# ~20% of an 800-token prompt's prefill on the built-in model, hence the floor.
SNAPSHOT_ALIGN = 256
SNAPSHOT_MIN_PREFIX = 1024
SNAPSHOT_MIN_GAIN = 512


def snapshot_aligned_chunk(num_computed: int, seq_len: int, tokens: int) -> int:
    """Tokens to run now: ``tokens``, or fewer so that a chunk finishing the prompt leaves an aligned snapshot."""
    if num_computed + tokens != seq_len:
        return tokens
    cut = (seq_len - 1) // SNAPSHOT_ALIGN * SNAPSHOT_ALIGN
    if cut < SNAPSHOT_MIN_PREFIX or cut - num_computed < SNAPSHOT_MIN_GAIN:
        return tokens
    return cut - num_computed


@dataclass
class NewTokenRatio:
    """Fraction of the remaining max_new_tokens that admission reserves per request."""

    initial: float
    minimum: float
    decay: float
    value: float = -1.0

    def __post_init__(self) -> None:
        assert 0.0 <= self.minimum <= self.initial <= 1.0, "0 <= minimum <= initial <= 1"
        if self.value < 0:
            self.value = self.initial

    @classmethod
    def from_conservativeness(cls, conservativeness: float) -> NewTokenRatio:
        initial = min(0.7 * conservativeness, 1.0)
        minimum = min(0.1 * conservativeness, initial)
        return cls(initial=initial, minimum=minimum, decay=(initial - minimum) / 600)

    def on_decode_step(self) -> None:
        self.value = max(self.minimum, self.value - self.decay)

    def on_retraction(self) -> None:
        self.value = min(1.0 if self.initial > 0 else 0.0, self.value + 0.3)
