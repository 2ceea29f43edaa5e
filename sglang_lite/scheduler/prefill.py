"""Admission and prefill batches: which waiting requests join the next extend forward and how many tokens each
runs (the pure ``policy``), their memory on admission, a prefix-cache hit, and where each goes afterwards
(decoding, or on as the chunked request)."""

from __future__ import annotations

from sglang_lite.forward_batch import ForwardMode
from sglang_lite.mem_cache.request_memory import RequestMemory
from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.scheduler.batch import ScheduleBatch
from sglang_lite.scheduler.policy import (
    PrefillBudget,
    order_waiting,
    plan_prefill,
    reserved_decode_tokens,
    snapshot_aligned_chunk,
)
from sglang_lite.scheduler.queues import RequestQueues
from sglang_lite.scheduler.request import Req, ReqStatus
from sglang_lite.scheduler.sampling import StepSampler


class PrefillManager:
    def __init__(
        self, config: SchedulerConfig, queues: RequestQueues, memory: RequestMemory
    ) -> None:
        self.config = config
        self.queues = queues
        self.memory = memory
        self.prompt_tokens_admitted = 0  # since start, re-admissions after a retraction not counted
        self.prompt_tokens_cached = 0  # of those, served from the prefix cache

    @property
    def has_candidates(self) -> bool:
        """Whether a request waits to be prefilled (or goes on with its chunks)."""
        return bool(self.queues.waiting) or self.queues.chunked is not None

    def schedule(self, reserved: int, new_token_ratio: float) -> ScheduleBatch | None:
        """The next prefill batch, or None. ``reserved``: KV slots the decoding requests still need."""
        queues = self.queues
        if not self.has_candidates:
            return None
        waiting = order_waiting(queues.waiting, self.config.schedule_policy)
        plan = plan_prefill(queues.chunked, waiting, self.budget(reserved, new_token_ratio))
        if not plan:
            return None
        reqs: list[Req] = []
        counts: list[int] = []
        for req, planned in plan:
            if not req.holds_memory:
                self._admit(req)
            # a prefix-cache hit at admission leaves fewer tokens to run than were planned
            n = min(planned, req.num_to_compute)
            aligned = n
            if self.memory.cache is not None:
                aligned = snapshot_aligned_chunk(req.num_computed, req.seq_len, n)
            reqs.append(req)
            counts.append(aligned)
            if (
                aligned < n
            ):  # it stops at an aligned snapshot and goes on as the chunked request: last
                break
        return ScheduleBatch(ForwardMode.EXTEND, reqs, counts)

    def budget(self, reserved: int, ratio: float) -> PrefillBudget:
        chunked = self.queues.chunked
        if chunked is not None:
            rest = self.memory.page_tokens(chunked.num_to_compute)
            reserved += rest + reserved_decode_tokens(chunked, ratio)
        kv_free = self.memory.kv_free
        return PrefillBudget(
            kv_free=kv_free,
            admit_free=kv_free - reserved,
            batch_tokens=self.config.max_prefill_tokens,
            chunk_size=self.config.chunk_size,
            free_rows=self.memory.free_rows,
            new_token_ratio=ratio,
            page_size=self.memory.page_size,
        )

    def _admit(self, req: Req) -> None:
        admitted = self.memory.admit(req)
        assert admitted, "the plan admits only while rows are free"
        self.queues.waiting.remove(req)
        req.status = ReqStatus.PREFILLING
        # prompt log-probabilities need their positions' logits; at least one token is left to run
        limit = StepSampler.prefix_limit(req)
        hit = self.memory.reuse_prefix(req, req.seq_len - 1 if limit is None else limit)
        if req.num_retractions == 0:  # a re-admission is not a new prompt
            prompt = len(req.input_ids)
            self.prompt_tokens_admitted += prompt
            self.prompt_tokens_cached += min(hit, prompt)
            req.prompt_tokens_from_cache = min(hit, prompt)

    def place_prefilled(self, reqs: list[Req], completes: list[bool]) -> None:
        """After an extend forward: a request whose prompt is done decodes, one that is not stays chunked."""
        queues = self.queues
        for req, done in zip(reqs, completes):
            if req is queues.chunked:
                queues.chunked = None
            if req.finished or req.status is ReqStatus.TRANSFERRING:
                continue
            if done:
                req.status = ReqStatus.DECODING
                queues.running.append(req)
            else:
                queues.chunked = req
            # the KV so far and the state after it, for later requests: at the end of the prompt, and at chunk
            # boundaries (so that a prompt equal to a cached one still finds a snapshot before its last token)
            self.memory.cache_prefix(req)

    def tokens_to_prefill(self) -> int:
        """Prompt tokens not yet computed: waiting requests and the rest of the chunked one."""
        chunked = self.queues.chunked
        waiting = sum(r.num_to_compute for r in self.queues.waiting)
        return waiting + (chunked.num_to_compute if chunked else 0)

    @property
    def cache_hit_rate(self) -> float:
        return self.prompt_tokens_cached / max(self.prompt_tokens_admitted, 1)
