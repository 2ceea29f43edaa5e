"""Decode batches and retraction: every decoding request runs one token a step; when the KV pool cannot hold
that step (a new page for each request whose last page is full), unused cached prefixes go first, then the newest
requests are retracted (all they hold is freed and
they wait again, their output so far kept for re-prefill). ``new_token_ratio`` follows how it goes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from sglang_lite.mem_cache.request_memory import RequestMemory
from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.scheduler.batch import ScheduleBatch
from sglang_lite.scheduler.policy import NewTokenRatio, reserved_decode_tokens
from sglang_lite.scheduler.queues import RequestQueues
from sglang_lite.scheduler.request import Req, ReqStatus
from sglang_lite.utils import schedule_flags


class AdmissionOrder:
    """Numbers each admission (a listener of ``RequestMemory``): retraction takes the newest."""

    def __init__(self) -> None:
        self.count = 0

    def on_admit(self, req: Req) -> None:
        req.admit_seq = self.count
        self.count += 1

    def on_release(self, req: Req) -> None:
        pass


class Arrivals(Protocol):
    """Commands arriving at the rank, as a run of decode steps watches for them (``runtime/scheduler_process.py``'s
    inbox): a run ends at the end of the step in which one arrives, so a new request waits one step at most."""

    fd: int  # a file descriptor that turns readable once a command arrives after ``waiting`` was last asked

    def waiting(self) -> bool:
        """Whether a command waits now (from then on ``fd`` turns readable when another arrives)."""
        ...

    def arrived(self) -> bool:
        """Whether ``fd`` is readable now."""
        ...


class DecodeManager:
    def __init__(
        self,
        config: SchedulerConfig,
        queues: RequestQueues,
        memory: RequestMemory,
        tokens_per_step: Callable[[Req], int] = lambda req: 1,
    ) -> None:
        """``tokens_per_step``: positions a request's decode step runs (its drafts too, with speculation)."""
        self.queues = queues
        self.memory = memory
        self.tokens_per_step = tokens_per_step
        self.max_steps = config.decode_steps
        self.step_seconds = (
            0.0  # a decode step's recent time (a moving average): bounds a run of steps
        )
        self.new_token_ratio = NewTokenRatio.from_conservativeness(config.schedule_conservativeness)
        self.num_retractions = 0
        # the rank's arrivals (set by its loop where it has them): a run then ends at the step a command arrives,
        # and only a run with a streaming request keeps to the time budget
        self.arrivals: Arrivals | None = None

    def schedule(self, back_to_back: bool = False) -> ScheduleBatch | None:
        """The next decode batch: every running request, retracting the newest while the KV pool cannot hold the
        step. ``back_to_back``: nothing waits, so it may run several steps (``_steps``)."""
        running = self.queues.running
        if not running:
            return None
        # unused cached prefixes go before any request is retracted; a retracted request's KV goes to the cache on
        # its way out, unused from then on
        needed = self._pages_needed()
        self.memory.make_room(needed)
        while self.memory.free_pages < needed:
            self._retract(self._victim())
            needed = self._pages_needed()
            self.memory.make_room(needed)
        steps = self._steps() if back_to_back and self.max_steps > 1 else 1
        return ScheduleBatch.decode(self.queues.running, steps)

    def _steps(self) -> int:
        """Decode steps the running requests may run back to back: up to ``--num-continuous-decode-steps``, none
        past a request's length limit, and only into KV pages free now (never evicting or retracting for them);
        one while a command waits. Within ``schedule_flags.RUN_BUDGET_S`` at the recent step time where a request
        streams (its tokens leave after the run) or the rank has no ``arrivals`` (a request arriving meanwhile
        waits for the run)."""
        running = self.queues.running
        if not self.step_seconds:  # the first steps: how long one takes is not known yet
            return 1
        if self.arrivals is not None and self.arrivals.waiting():
            return 1  # taken after this step
        steps = min(self.max_steps, *(r.remaining_new_tokens for r in running))
        if self.arrivals is None or any(r.stream for r in running):
            steps = min(steps, int(schedule_flags.RUN_BUDGET_S / self.step_seconds))
        if (
            steps > 1
            and self.memory.pages_needed(running, [steps] * len(running)) > self.memory.free_pages
        ):
            return 1
        return max(steps, 1)

    def _pages_needed(self) -> int:
        """New KV pages the next step takes: one for each running request whose last page is full (more with
        drafts to verify)."""
        running = self.queues.running
        return self.memory.pages_needed(running, [self.tokens_per_step(r) for r in running])

    def reserved_decode_tokens(self) -> int:
        """KV slots the running requests are expected to need for their remaining output."""
        ratio = self.new_token_ratio.value
        return sum(reserved_decode_tokens(r, ratio) for r in self.queues.running)

    def on_step(self, steps: int = 1, seconds: float = 0.0) -> None:
        """``steps`` decode steps ran (back to back), in ``seconds``."""
        for _ in range(steps):
            self.new_token_ratio.on_decode_step()
        if steps and seconds > 0:
            per_step = seconds / steps
            previous = self.step_seconds or per_step
            self.step_seconds = 0.8 * previous + 0.2 * per_step

    def join(self, req: Req) -> None:
        """A request whose prompt another server computed (PD) decodes from here."""
        self.queues.running.append(req)

    def _victim(self) -> Req:
        """The newest request holding memory, keeping at least one decoding request."""
        queues = self.queues
        keep_one = len(queues.running) == 1
        candidates = [r for r in queues.holders if not (keep_one and r in queues.running)]
        assert candidates, "one request alone always fits the KV pool (validated at admission)"
        return max(candidates, key=lambda r: r.admit_seq)

    def _retract(self, req: Req) -> None:
        self.memory.release(req)
        if req is self.queues.chunked:
            self.queues.chunked = None
        else:
            self.queues.running.remove(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        self.queues.waiting.append(req)
        self.num_retractions += 1
        self.new_token_ratio.on_retraction()
