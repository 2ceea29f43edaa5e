"""Speculative decoding: the scheduler's ``Speculation`` (none, or drafts verified in one forward) and the drafters
(``base.py`` says what each is)."""

from __future__ import annotations

import importlib

from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.mem_cache.request_memory import RequestMemory
from sglang_lite.model_executor import Runner
from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.scheduler.output import OutputProcessor
from sglang_lite.scheduler.speculative.base import DraftContext, Drafter, SpecStats, Speculation
from sglang_lite.scheduler.speculative.null import NullSpeculation
from sglang_lite.scheduler.speculative.verify import DraftVerify
from sglang_lite.utils.speculative_flags import ALGORITHMS


def create_speculation(
    config: SchedulerConfig,
    runner: Runner,
    pools: ModelPools,
    memory: RequestMemory,
    output: OutputProcessor,
) -> Speculation:
    """The rank's speculation: none without ``config.speculative_algorithm``, else its drafter's chains of
    ``speculative_steps`` tokens verified by the model (NEXTN needs a runner whose model has its MTP head)."""
    if config.speculative_algorithm is None:
        return NullSpeculation(runner, pools, memory, output, config.device)
    drafter = create_drafter(config.speculative_algorithm, DraftContext(runner, pools, config))
    return DraftVerify(
        drafter, config.speculative_steps, runner, pools, memory, output, config.device
    )


def create_drafter(algorithm: str, context: DraftContext) -> Drafter:
    """The drafter of ``algorithm``: the ``DRAFTER`` of the module ``ALGORITHMS`` names for it."""
    module = importlib.import_module(f"{__name__}.{ALGORITHMS[algorithm].module}")
    return module.DRAFTER(context)


__all__ = [
    "DraftVerify",
    "Drafter",
    "NullSpeculation",
    "SpecStats",
    "Speculation",
    "create_speculation",
]
