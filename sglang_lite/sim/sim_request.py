"""A simulated request: its lengths, where it is, and the times it passed each stage."""

from __future__ import annotations

from dataclasses import dataclass

from sglang_lite.sim.traces import TraceRequest


@dataclass(eq=False)
class SimRequest:
    rid: int
    trace: TraceRequest
    client: int
    arrival: float
    decode_rank: int = -1  # global rank index, set by the router
    prefill_server: int = -1
    # the fields the scheduler's admission policy reads (see sglang_lite.scheduler.policy)
    num_to_compute: int = 0
    remaining_new_tokens: int = 0
    arrival_time: float = 0.0
    # progress
    prefill_done: int = 0  # input tokens prefilled (the cached prefix counts as done)
    first_token_time: float = -1.0
    finish_time: float = -1.0
    finish_step: int = -1  # the decode server's step count at which its last token is out
    finished: bool = False

    @property
    def input_len(self) -> int:
        return self.trace.input_len

    @property
    def output_len(self) -> int:
        return self.trace.output_len

    @property
    def decode_steps(self) -> int:
        """Steps on the decode server: the prefill server produced the first token."""
        return self.output_len - 1

    def tpot(self) -> float | None:
        if self.decode_steps <= 0 or self.finish_time < 0:
            return None
        return (self.finish_time - self.first_token_time) / self.decode_steps
