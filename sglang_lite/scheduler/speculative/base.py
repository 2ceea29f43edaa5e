"""The two interfaces of speculative decoding.

``Speculation`` is what the scheduler calls in every step, with or without speculation: how many positions a
request's decode step runs, the prefill forward, what follows a prefill, and a whole decode step.
``NullSpeculation`` (``null.py``) runs plain decode steps; ``DraftVerify`` (``verify.py``) drafts, verifies the
drafts in one forward of the model and keeps what the model agrees with.

``Drafter`` is what ``DraftVerify`` asks of an algorithm: how many tokens it has drafted for a request, the
drafts themselves, and what it learns from the tokens a prefill or a verify step kept. ``mtp.py`` (NEXTN: the
checkpoint's MTP head) and ``ngram.py`` (NGRAM: prompt lookup) are the two; a third is one module with a
``DRAFTER`` class and its name in ``utils/speculative_flags.ALGORITHMS``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch

from sglang_lite.forward_batch import ForwardBatch
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.model_executor import Runner
from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.scheduler.batch import ScheduleBatch
from sglang_lite.scheduler.request import Req


@dataclass
class SpecStats:
    """Since start: verify steps (one per request and decode step, with drafts or not), drafts proposed, drafts
    accepted, tokens produced by those steps."""

    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0

    @property
    def accept_length(self) -> float:
        """Tokens per verify step (accepted drafts plus the corrected or bonus token)."""
        return self.tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Speculation(Protocol):
    stats: SpecStats

    def tokens_per_step(self, req: Req) -> int:
        """Positions the request's next decode step runs: its last token and its drafts."""
        ...

    def forward_extend(self, forward_batch: ForwardBatch, all_logits: bool) -> torch.Tensor:
        """A prefill forward: logits of each request's last new token, or of every new token (``all_logits``)."""
        ...

    def extend_greedy(self, forward_batch: ForwardBatch) -> torch.Tensor | None:
        """A prefill forward's argmax token of each request (``Runner.extend_greedy``), where the speculation takes
        no more from it than that; None: nothing ran, the caller takes ``forward_extend``'s logits."""
        ...

    def after_extend(self, reqs: list[Req]) -> None:
        """After a prefill forward's tokens were sampled and placed: drafts for the requests now decoding."""
        ...

    def run_decode(self, batch: ScheduleBatch, kv_slots: list[int]) -> None:
        """One decode step of ``batch`` in the KV slots allocated for its ``tokens_per_step``: forward, sample,
        append. On an exception the slots are freed and the step's requests are the scheduler's to fail."""
        ...


@dataclass(frozen=True)
class DraftContext:
    """What a drafter may use: the model, the pools, the scheduler's configuration."""

    runner: Runner
    pools: ModelPools
    config: SchedulerConfig


@dataclass
class Kept:
    """Positions ``start..`` of a request that a forward computed and the request keeps: the tokens that follow
    each position (``following[j]`` comes after position ``start + j``), and the model's final hidden states there
    (None unless the drafter ``keeps_hidden``)."""

    req: Req
    start: int
    following: list[int]
    hidden: torch.Tensor | None


class Drafter(ABC):
    """Proposes a chain of tokens for each request; ``DraftVerify`` verifies them."""

    # whether the prefill and verify forwards hand it the model's hidden states (``Kept.hidden``)
    keeps_hidden = False

    def __init__(self, context: DraftContext) -> None:
        self.context = context

    @abstractmethod
    def num_drafts(self, req: Req) -> int:
        """Tokens drafted for the request's next step (``DraftVerify`` cuts them to the steps and the request's
        length limit)."""

    @abstractmethod
    def propose(
        self, reqs: list[Req], counts: list[int], starts: list[int], slots: list[list[int]]
    ) -> list[list[int]]:
        """Each request's chain of ``counts[i] - 1`` drafts, to be verified at positions ``starts[i] + 1..``
        (``slots[i]``: the KV slots of its ``counts[i]`` positions, which the verify forward fills)."""

    @abstractmethod
    def after_prefill(self, kept: list[Kept]) -> None:
        """A prefill forward computed these positions (of requests that may be drafted for)."""

    @abstractmethod
    def after_verify(self, kept: list[Kept]) -> None:
        """A verify step kept these positions, the tokens following them already appended to the requests."""


def drafts_for(req: Req) -> bool:
    """Whether the request may be drafted for: it has no grammar (whose matcher would have to follow the drafts)."""
    return req.grammar is None
