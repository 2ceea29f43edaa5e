"""A request's state inside a rank's scheduler and its finish reason."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_lite.protocol.outputs import INTERNAL_ERROR, PD_FAILURE
from sglang_lite.sampling.grammar import ReasoningGrammar, RequestGrammar
from sglang_lite.sampling.logprobs import LogprobParams, LogprobRecord
from sglang_lite.sampling.params import SamplingParams
from sglang_lite.tokenizer.detokenizer import IncrementalDetokenizer, StopStringMatcher


@dataclass(frozen=True)
class FinishReason:
    kind: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # stop: the token id or stop string
    length: int | None = None  # length: completion tokens
    message: str | None = None  # abort: why
    # abort: 500 when the request failed inside the rank (SGLang's shape)
    status_code: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The SGLang ``meta_info.finish_reason`` shape."""
        detail = {
            "stop": ("matched", self.matched),
            "length": ("length", self.length),
            "abort": ("message", self.message),
        }
        key, value = detail[self.kind]
        shape = {"type": self.kind, key: value}
        return shape if self.status_code is None else {**shape, "status_code": self.status_code}

    @property
    def is_internal_error(self) -> bool:
        """It failed inside the server (500) or its PD pair (502), not by the client's doing."""
        return self.kind == "abort" and self.status_code in (INTERNAL_ERROR, PD_FAILURE)


class ReqStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no memory
    PREFILLING = "prefilling"  # holds a row, a state slot and KV; part of its tokens are cached (chunked prefill)
    DECODING = "decoding"  # every token but the newest is cached
    # PD: holds memory while its KV and state move (prefill: out, decode: in)
    TRANSFERRING = "transferring"
    FINISHED = "finished"  # holds nothing


@dataclass(eq=False)  # identity: a request is itself, whatever its fields
class Req:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    # the request's, clipped so that prompt + output fits the context and the KV pool
    max_new_tokens: int
    # eos ids (unless ignore_eos) and the request's own
    stop_token_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    # the generator's: batch invariant, each draw reseeds it from this and the position
    seed: int = 0
    detokenizer: IncrementalDetokenizer | None = None
    stop_matcher: StopStringMatcher | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    # what it holds (``mem_cache.request_memory``): a row of req_to_token, a state slot, and the positions
    # 0..num_computed whose KV and linear-attention state are in the pools; the first cache_owned_len of them
    # are the prefix cache's (read in place, never freed by the request), locked through cache_node
    req_row: int | None = None
    state_slot: int | None = None
    num_computed: int = 0
    cache_owned_len: int = 0
    cache_node: Any = None
    # prompt tokens served from the prefix cache when it was admitted (``cached_tokens`` in its output)
    prompt_tokens_from_cache: int = 0
    admit_seq: int = -1  # admission order; retraction takes the newest
    num_retractions: int = 0
    finish_reason: FinishReason | None = None
    first_token_time: float | None = None
    # PD disaggregation: the transfer's id, shared by the two sides
    bootstrap_room: int | None = None
    # PD prefill side: where the decode rank wants the data
    transfer_target: dict[str, Any] | None = None
    logprob: LogprobParams | None = None  # the log-probabilities it asked for
    stream: bool = True  # outputs every stream_interval tokens; False: one output, when it finishes
    logprob_record: LogprobRecord = field(default_factory=LogprobRecord)
    # n > 1: rids of the parallel samples not yet forked from it; fork i draws with seed fork_seed + i
    forks: list[str] = field(default_factory=list)
    fork_seed: int = 0
    # structured output: where its output is in its grammar (once compiled)
    grammar: RequestGrammar | ReasoningGrammar | None = None
    # speculative decoding: the MTP head's first draft of the next step (``scheduler.speculative.Drafts``), the
    # verify forwards it took part in, the drafts it was proposed and those it accepted
    drafts: Any = None
    spec_verify_ct: int = 0
    spec_drafted: int = 0
    spec_accepted_drafts: int = 0
    # its images (``scheduler/images.py``; None: a text prompt)
    images: Any = None
    # what the next ReqOutput carries
    unsent_ids: list[int] = field(default_factory=list)
    unsent_text: str = ""

    def __post_init__(self) -> None:
        assert self.input_ids, "a request needs at least one prompt token"
        assert 0 <= self.max_new_tokens, "max_new_tokens is clipped to >= 0"

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def fill_ids(self) -> list[int]:
        """Every token the cache must hold before the next one can be sampled."""
        return self.input_ids + self.output_ids

    @property
    def num_to_compute(self) -> int:
        """Tokens still to run before the next one can be sampled."""
        return self.seq_len - self.num_computed

    @property
    def holds_memory(self) -> bool:
        return self.req_row is not None

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.max_new_tokens - len(self.output_ids), 0)

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    def check(self) -> None:
        """Invariants tying the status to what the request holds."""
        holds = self.status in (ReqStatus.PREFILLING, ReqStatus.DECODING, ReqStatus.TRANSFERRING)
        assert self.holds_memory == holds == (self.state_slot is not None), (
            f"{self.rid}: {self.status} vs memory"
        )
        assert holds or self.num_computed == 0, f"{self.rid}: computed tokens without memory"
        assert 0 <= self.num_computed <= self.seq_len, (
            f"{self.rid}: {self.num_computed} computed of {self.seq_len}"
        )
        assert 0 <= self.cache_owned_len <= self.num_computed, (
            f"{self.rid}: the cache owns {self.cache_owned_len} positions"
        )
        assert self.status is not ReqStatus.DECODING or self.num_computed == self.seq_len - 1, (
            f"{self.rid}: decode lag"
        )
