"""Alternate-stream overlap for Qwen3.5: the plan (which sites overlap) and the runtime (streams, fork/join)."""

from sglang_lite.streams.plan import (
    StreamFlags,
    StreamPlan,
    choose_overlap_per_batch_size,
    decide_stream_plan,
    has_alt_stream,
)
from sglang_lite.streams.runtime import OverlapContext, StreamRuntime, overlap

__all__ = [
    "OverlapContext",
    "StreamFlags",
    "StreamPlan",
    "StreamRuntime",
    "choose_overlap_per_batch_size",
    "decide_stream_plan",
    "has_alt_stream",
    "overlap",
]
