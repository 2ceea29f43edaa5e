"""A small stream runtime: named streams created once (outside graph capture) and a fork/join helper.

``overlap(main, side, ...)`` runs ``main`` on the current stream and ``side`` on the alternate stream, then joins;
with overlap off (or on the CPU) it simply runs both in order, so every site reads the same either way:

    qkvz, ba = overlap(lambda: self.in_proj_qkvz(x), lambda: self.in_proj_ba(x), ctx.alt, ctx.plan.gdn_qkvz_ba, x)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

from sglang_lite.streams.plan import StreamPlan

A = TypeVar("A")
B = TypeVar("B")


class StreamRuntime:
    """The named streams of one model, created on first use and never inside a CUDA-graph capture."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._streams: dict[str, torch.cuda.Stream] = {}

    def get(self, name: str = "alt") -> torch.cuda.Stream | None:
        if self.device.type != "cuda":
            return None
        if name not in self._streams:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"stream {name!r} must be created before CUDA-graph capture starts"
                )
            self._streams[name] = torch.cuda.Stream(device=self.device)
        return self._streams[name]


@dataclass(frozen=True)
class OverlapContext:
    """What a layer needs to overlap: this forward's plan and the alternate stream (None on the CPU)."""

    plan: StreamPlan
    alt: torch.cuda.Stream | None


PLAIN = OverlapContext(
    StreamPlan(
        alt_stream=False,
        gdn_qkvz_ba=False,
        qk_norm=False,
        moe_shared_routed=False,
        fused_qk_norm=False,
        shared_experts_fusion=False,
    ),
    None,
)


def overlap(
    main: Callable[[], A],
    side: Callable[[], B],
    alt: torch.cuda.Stream | None,
    enabled: bool,
    *side_inputs: torch.Tensor,
) -> tuple[A, B]:
    """Fork: the alternate stream waits for the work so far; ``main`` runs here, ``side`` there. Join: this stream
    waits for the alternate one before anything uses ``side``'s result."""
    if not enabled or alt is None:
        return main(), side()
    current = torch.cuda.current_stream()
    alt.wait_stream(current)
    main_out = main()
    with torch.cuda.stream(alt):
        side_out = side()
    current.wait_stream(alt)
    # Eager mode: tell the caching allocator which streams use which blocks, so that neither an input of the
    # side work (freed on this stream) nor its output (allocated on the alternate one) is reused too early.
    for tensor in side_inputs:
        tensor.record_stream(alt)
    for tensor in _tensors(side_out):
        tensor.record_stream(current)
    return main_out, side_out


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []
