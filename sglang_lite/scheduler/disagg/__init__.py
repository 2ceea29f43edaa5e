"""Prefill/decode disaggregation inside one scheduler: SGLang's PD queues on each side (``prefill.py``,
``decode.py``) behind the small interface of ``base.py``; a rank that serves whole requests has a ``NullSide``."""

from __future__ import annotations

from sglang_lite.disaggregation.transfer import MooncakeTransfer
from sglang_lite.mem_cache.request_memory import RequestMemory
from sglang_lite.scheduler.disagg.base import DisaggSide, NullSide, SideHost
from sglang_lite.scheduler.disagg.decode import DecodeSide
from sglang_lite.scheduler.disagg.prefill import PrefillSide

__all__ = ["DecodeSide", "DisaggSide", "NullSide", "PrefillSide", "SideHost", "create_side"]


def create_side(
    mode: str, transfer: MooncakeTransfer, memory: RequestMemory, timeout_s: float
) -> PrefillSide | DecodeSide:
    return (PrefillSide if mode == "prefill" else DecodeSide)(transfer, memory, timeout_s)
