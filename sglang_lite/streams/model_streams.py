"""The stream settings of one model instance, fixed when the model is built.

Building a model reads the environment flags and the (global) server arguments once; each forward then asks for
its ``OverlapContext``. Two models built under different flags in one process therefore follow different plans.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from sglang_lite.server_args import ServerArgs
from sglang_lite.streams.plan import StreamFlags, StreamPlan, decide_stream_plan
from sglang_lite.streams.runtime import OverlapContext, StreamRuntime

logger = logging.getLogger(__name__)


def detect_platform(device: torch.device | str) -> str:
    if torch.device(device).type != "cuda":
        return "cpu"
    return "rocm" if torch.version.hip else "cuda"


@dataclass
class ModelStreams:
    platform: str
    flags: StreamFlags
    disable_shared_experts_fusion: bool
    fusion_supported: bool
    has_moe: bool
    runtime: StreamRuntime
    # the ``auto`` choice per captured decode batch size (filled by the CUDA-graph runner)
    overlap_by_batch_size: dict[int, bool] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        device: torch.device | str,
        server_args: ServerArgs,
        has_moe: bool,
        fusion_supported: bool,
        fusion_blocker: str = "",
    ) -> ModelStreams:
        streams = cls(
            detect_platform(device),
            StreamFlags.from_env(),
            server_args.disable_shared_experts_fusion,
            fusion_supported,
            has_moe,
            StreamRuntime(device),
        )
        if has_moe and not server_args.disable_shared_experts_fusion and not fusion_supported:
            logger.warning("shared-expert fusion off: %s", fusion_blocker)
        return streams

    @property
    def shared_experts_fusion(self) -> bool:
        return self.plan(capturing=False, num_tokens=1).shared_experts_fusion

    def plan(self, capturing: bool, num_tokens: int, batch_size: int | None = None) -> StreamPlan:
        override = self.overlap_by_batch_size.get(batch_size) if batch_size is not None else None
        return decide_stream_plan(
            self.platform,
            self.flags,
            self.disable_shared_experts_fusion,
            self.fusion_supported,
            capturing,
            num_tokens,
            override,
            self.has_moe,
        )

    def context(
        self, capturing: bool, num_tokens: int, batch_size: int | None = None
    ) -> OverlapContext:
        plan = self.plan(capturing, num_tokens, batch_size)
        return OverlapContext(plan, self.runtime.get() if plan.any_overlap else None)

    def describe(self) -> dict:
        """The plan for reporting (startup log, /get_server_info): decode under capture and an eager prefill."""
        return {
            "platform": self.platform,
            "flags": {k: v for k, v in vars(self.flags).items()},
            "decode_captured": self.plan(capturing=True, num_tokens=1).to_json(),
            "prefill_eager": self.plan(capturing=False, num_tokens=4096).to_json(),
            "auto_overlap_by_batch_size": dict(self.overlap_by_batch_size),
        }
