"""No speculation: a decode step runs one token per request, and a prefill forward is the model's."""

from __future__ import annotations

import torch

from sglang_lite.forward_batch import ForwardBatch
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.mem_cache.request_memory import RequestMemory
from sglang_lite.model_executor import Runner
from sglang_lite.scheduler.batch import ScheduleBatch
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

    def tokens_per_step(self, req: Req) -> int:
        return 1

    def forward_extend(self, forward_batch: ForwardBatch, all_logits: bool) -> torch.Tensor:
        return self.runner.forward_batch(forward_batch, all_logits)

    def after_extend(self, reqs: list[Req]) -> None:
        pass

    def run_decode(self, batch: ScheduleBatch, kv_slots: list[int]) -> None:
        forward_batch = batch.forward_batch(self.pools, self.device, kv_slots)
        try:
            with torch.inference_mode():
                logits = self.runner.forward_batch(forward_batch)
        except BaseException:
            self.memory.free_kv(kv_slots)  # computed nothing: the requests fail without them
            raise
        batch.advance()
        self.output.process(batch, logits)
