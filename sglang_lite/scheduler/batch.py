"""One scheduled forward: its mode, its requests and how many new tokens each runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_lite.forward_batch import ForwardBatch, ForwardMode, build_forward_batch
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.scheduler.request import Req


@dataclass
class ScheduleBatch:
    mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]
    # decode: steps run back to back (``--num-continuous-decode-steps``), KV slots allocated for each; after the
    # run, the steps that ran
    steps: int = 1
    # which requests run their last uncomputed token, so sample a next token (fixed when it is scheduled)
    completes: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        assert self.reqs and len(self.reqs) == len(self.extend_lens), (
            "one extend length per request"
        )
        assert all(r.holds_memory for r in self.reqs), (
            "scheduled requests hold a row and a state slot"
        )
        assert all(0 < n <= r.num_to_compute for r, n in zip(self.reqs, self.extend_lens)), (
            "runs only uncomputed tokens"
        )
        assert self.mode is ForwardMode.EXTEND or all(n == 1 for n in self.extend_lens), (
            "decode runs 1 token each"
        )
        assert self.steps == 1 or self.mode is ForwardMode.DECODE, (
            "steps back to back are decode steps"
        )
        self.completes = [n == r.num_to_compute for r, n in zip(self.reqs, self.extend_lens)]

    @classmethod
    def decode(cls, reqs: list[Req], steps: int = 1) -> ScheduleBatch:
        return cls(ForwardMode.DECODE, list(reqs), [1] * len(reqs), steps)

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE

    @property
    def prefix_lens(self) -> list[int]:
        return [r.num_computed for r in self.reqs]

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def new_token_ids(self) -> list[list[int]]:
        if self.is_decode:
            return [[r.output_ids[-1]] for r in self.reqs]
        return [
            r.fill_ids[r.num_computed : r.num_computed + n]
            for r, n in zip(self.reqs, self.extend_lens)
        ]

    def forward_batch(self, pools: ModelPools, device: str, kv_slots: list[int]) -> ForwardBatch:
        """The model's input for this batch, its new tokens' KV going to ``kv_slots``."""
        offsets = None
        if any(r.images is not None for r in self.reqs):
            offsets = [r.images.delta if r.images is not None else 0 for r in self.reqs]
        return build_forward_batch(
            pools,
            self.mode,
            self.new_token_ids(),
            self.prefix_lens,
            [r.req_row for r in self.reqs],
            [r.state_slot for r in self.reqs],
            device,
            kv_slots,
            offsets,
        )

    def advance(self) -> None:
        """The forward ran: its new tokens are computed (their KV slots are in the requests' rows)."""
        for req, n in zip(self.reqs, self.extend_lens):
            req.num_computed += n
