"""Parallel samples (``n > 1``): a request's siblings are forked when its prompt has been prefilled. Each gets
its own row and state slot, the prompt's KV (shared through the prefix cache, else copied) and a copy of the
state, and draws its first token from the parent's logits; one that cannot get memory waits and prefills like
any request."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from sglang_lite.mem_cache.request_memory import RequestMemory
from sglang_lite.sampling.params import SamplingParams
from sglang_lite.scheduler.queues import RequestQueues
from sglang_lite.scheduler.request import Req, ReqStatus

NewReq = Callable[[str, list[int], SamplingParams, int], Req]


class ForkManager:
    def __init__(self, queues: RequestQueues, memory: RequestMemory, new_req: NewReq) -> None:
        self.queues = queues
        self.memory = memory
        self.new_req = new_req

    def fork(self, parent: Req) -> list[Req]:
        """The parallel samples of ``parent``, whose prompt was just prefilled, that decode from here."""
        if not parent.forks:
            return []
        assert not parent.output_ids, "parallel samples fork before the first token"
        self.memory.cache_prefix(
            parent
        )  # the cache then owns the prompt's KV, which every sample reads
        forked = []
        for i, rid in enumerate(parent.forks, start=1):
            child = self._child(parent, rid, parent.fork_seed + i)
            if self.memory.share_prompt(parent, child):
                child.status = ReqStatus.DECODING
                child.prompt_tokens_from_cache = parent.prompt_tokens_from_cache
                self.queues.running.append(child)
                forked.append(child)
            else:
                self.queues.waiting.append(child)
        parent.forks = []
        return forked

    def _child(self, parent: Req, rid: str, seed: int) -> Req:
        params = dataclasses.replace(parent.sampling_params, n=1, seed=seed)
        child = self.new_req(rid, list(parent.input_ids), params, seed)
        child.arrival_time = parent.arrival_time
        child.logprob = parent.logprob
        child.stream = parent.stream
        child.grammar = parent.grammar.restarted() if parent.grammar is not None else None
        child.logprob_record = parent.logprob_record.copy_input()
        return child

    def parent_of(self, rid: str) -> Req | None:
        """The unfinished request that will fork the parallel sample ``rid``."""
        return next((r for r in self.queues.unfinished if rid in r.forks), None)
