"""Where each unfinished request of a rank is: waiting, part-way through its prefill (chunked), or decoding.

Requests in a PD queue are the rank's PD side's (``pd_side/``); those whose grammar compiles are the grammar
queue's. The prefill and decode managers move requests between these three places; ending one takes it out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_lite.scheduler.request import Req


@dataclass
class RequestQueues:
    waiting: list[Req] = field(default_factory=list)  # holds nothing
    running: list[Req] = field(default_factory=list)  # decoding
    chunked: Req | None = None  # part-way through its prefill

    @property
    def holders(self) -> list[Req]:
        """The requests holding memory: decoding, and the one part-way through its prefill."""
        return self.running + ([self.chunked] if self.chunked else [])

    @property
    def unfinished(self) -> list[Req]:
        return self.waiting + self.holders

    def __bool__(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def find(self, rid: str) -> Req | None:
        return next((r for r in self.unfinished if r.rid == rid), None)

    def take_out(self, req: Req) -> None:
        """An ending request leaves the waiting queue now; the running list and the chunked place drop it at the
        end of the step (``drop_finished``), as the step may still be walking them."""
        if req in self.waiting:
            self.waiting.remove(req)

    def drop_finished(self) -> None:
        self.running = [r for r in self.running if not r.finished]
        if self.chunked is not None and self.chunked.finished:
            self.chunked = None
