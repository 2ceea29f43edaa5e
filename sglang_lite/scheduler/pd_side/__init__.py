"""The rank's side of prefill/decode disaggregation inside one scheduler: SGLang's PD queues on each side
(``prefill_side.py``, ``decode_side.py``; the prefill side's writes on ``transfer_threads.py``) behind the small
interface of ``base.py``; a rank that serves whole requests has a ``NullSide``. The other PD places: the transport
(``sglang_lite/pd_transport/``), the server's front (``server/pd_front.py``) and the router
(``router/pd_router.py``)."""

from __future__ import annotations

from sglang_lite.mem_cache.request_memory import RequestMemory
from sglang_lite.pd_transport.layout import PoolShard
from sglang_lite.pd_transport.transfer import MooncakeTransfer
from sglang_lite.scheduler.pd_side.base import AttentionGroup, DisaggSide, NullSide, SideHost
from sglang_lite.scheduler.pd_side.decode_side import DecodeSide
from sglang_lite.scheduler.pd_side.prefill_side import PrefillSide

__all__ = [
    "AttentionGroup",
    "DecodeSide",
    "DisaggSide",
    "NullSide",
    "PrefillSide",
    "SideHost",
    "create_side",
]
# the decode side's area for requests' log-probabilities (a 4k-token prompt's with 20 top entries: 0.7 MB); the
# prefill side stages them in one that grows as needed
DECODE_EXTRAS_BYTES = 16 * 1024 * 1024
PREFILL_EXTRAS_BYTES = 1024 * 1024


def create_side(
    mode: str,
    transfer: MooncakeTransfer,
    memory: RequestMemory,
    timeout_s: float,
    group: AttentionGroup,
    shard: PoolShard,
) -> PrefillSide | DecodeSide:
    """This rank's side of ``mode``; every rank of ``group`` builds its own at once (they exchange layouts)."""
    if mode == "prefill":
        return PrefillSide(transfer, memory, timeout_s, group, shard, PREFILL_EXTRAS_BYTES)
    return DecodeSide(transfer, memory, timeout_s, group, shard, DECODE_EXTRAS_BYTES)
