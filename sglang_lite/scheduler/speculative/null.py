"""No speculation: a decode step runs one token per request, and a prefill forward is the model's."""

from __future__ import annotations

import torch

from sglang_lite.forward_batch import ForwardBatch, host_ints
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.mem_cache.request_memory import RequestMemory
from sglang_lite.model_executor import Runner
from sglang_lite.scheduler.batch import ScheduleBatch
from sglang_lite.scheduler.decode import Arrivals
from sglang_lite.scheduler.output import OutputProcessor
from sglang_lite.scheduler.request import Req
from sglang_lite.scheduler.speculative.base import SpecStats


class NullSpeculation:
    """The ``Speculation`` of a rank without it."""

    def __init__(
        self,
        runner: Runner,
        pools: ModelPools,
        memory: RequestMemory,
        output: OutputProcessor,
        device: str,
    ) -> None:
        self.runner = runner
        self.pools = pools
        self.memory = memory
        self.output = output
        self.device = device
        self.stats = SpecStats()
        # the rank's arrivals (scheduler/decode.py), set with the decode manager's: a run ends at the step one comes
        self.arrivals: Arrivals | None = None

    def tokens_per_step(self, req: Req) -> int:
        return 1

    def forward_extend(self, forward_batch: ForwardBatch, all_logits: bool) -> torch.Tensor:
        return self.runner.forward_batch(forward_batch, all_logits)

    def extend_greedy(self, forward_batch: ForwardBatch) -> torch.Tensor | None:
        return self.runner.extend_greedy(forward_batch)

    def after_extend(self, reqs: list[Req]) -> None:
        pass

    def run_decode(self, batch: ScheduleBatch, kv_slots: list[int]) -> None:
        # one request takes the steps' path even for one step: where the runner has one call for greedy steps, its
        # token then comes through the LM head's greedy screen (kernels/cpu/csrc/greedy_head.h)
        if batch.steps > 1 or len(batch.reqs) == 1:
            self._run_steps(batch, kv_slots)
            return
        forward_batch = batch.forward_batch(self.pools, self.device, kv_slots)
        try:
            with torch.inference_mode():
                logits = self.runner.forward_batch(forward_batch)
        except BaseException:
            self.memory.free_kv(kv_slots)  # computed nothing: the requests fail without them
            raise
        batch.advance()
        self.output.process(batch, logits)

    def _run_steps(self, batch: ScheduleBatch, kv_slots: list[int]) -> None:
        """``batch.steps`` decode steps back to back (``--num-continuous-decode-steps``), the forward batch carried
        from step to step: each step samples and appends as a step alone, and the run ends after a step in which a
        request finished (or failed), so that no request computes past its end, or in which a command arrived
        (``arrivals``). ``kv_slots``: each request's slots of every step, request after request; those of the steps
        not run are freed. ``batch.steps`` becomes the steps that ran."""
        reqs, steps = batch.reqs, batch.steps
        per_step = [kv_slots[j::steps] for j in range(steps)]
        forward_batch = batch.forward_batch(self.pools, self.device, per_step[0])
        ran = 0
        try:
            if self.output.sampler.all_plain_greedy(reqs):
                ran = self._run_greedy(batch, forward_batch, per_step)
                if ran:
                    return
            for j in range(steps):
                if j:
                    tokens = [r.output_ids[-1] for r in reqs]
                    forward_batch.next_decode_step(
                        host_ints(tokens, torch.int64, self.device),
                        host_ints(per_step[j], torch.int64, self.device),
                    )
                with torch.inference_mode():
                    logits = self.runner.forward_batch(forward_batch)
                ran = j + 1
                batch.advance()
                self.output.process(batch, logits)
                if any(r.finished for r in reqs) or (
                    self.arrivals is not None and self.arrivals.arrived()
                ):
                    break
        finally:
            self.memory.free_kv([slot for slots in per_step[ran:] for slot in slots])
            batch.steps = ran

    def _run_greedy(
        self, batch: ScheduleBatch, forward_batch: ForwardBatch, per_step: list[list[int]]
    ) -> int:
        """The steps of ``_run_steps`` in one call of the runner where it has one (``Runner.decode_greedy``), for
        requests whose token is their row's argmax and whose ends the call can see (stop tokens; no stop strings):
        each step's tokens then appended as a step alone appends them. The steps that ran (0: no such call)."""
        reqs = batch.reqs
        if any(r.stop_matcher is not None for r in reqs):
            return 0
        stops = [sorted(r.stop_token_ids) for r in reqs]
        width = max(1, *(len(ids) for ids in stops))
        padded = [i for ids in stops for i in ids + [-1] * (width - len(ids))]
        slots = [slot for step in per_step for slot in step]
        wake_fd = self.arrivals.fd if self.arrivals is not None else -1
        with torch.inference_mode():
            tokens = self.runner.decode_greedy(
                forward_batch,
                host_ints(slots, torch.int64, self.device).view(len(per_step), len(reqs)),
                host_ints(padded, torch.int64, self.device).view(len(reqs), width),
                wake_fd,
            )
        if tokens is None:
            return 0
        rows = tokens.tolist()
        ended: set[int] = set()
        for j, row in enumerate(rows):
            # a request its detokeniser failed ends there (the KV of its later steps freed); the others take every
            # step that ran
            for i, req in enumerate(reqs):
                if req.finished and i not in ended:
                    ended.add(i)
                    self.memory.free_kv([per_step[k][i] for k in range(j, len(rows))])
            live = [i for i in range(len(reqs)) if i not in ended]
            for i in live:
                reqs[i].num_computed += 1
            self.output.append_tokens([reqs[i] for i in live], [row[i] for i in live])
        return len(rows)
