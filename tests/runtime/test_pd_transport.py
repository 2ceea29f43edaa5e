"""PD transport pieces without a second server: slots come back in runs, runs become few blocks, and a transfer
of many blocks goes out in batches the TCP transport accepts."""

from __future__ import annotations

from sglang_lite.disaggregation.layout import HeadRange, PoolLayout, PoolShard, request_blocks
from sglang_lite.disaggregation.transfer import MAX_BATCH_BLOCKS, MooncakeTransfer, TransferStats
from sglang_lite.mem_cache.pools import SlotAllocator


def test_freed_slots_come_back_ascending():
    allocator = SlotAllocator(64, "kv")
    first = allocator.alloc(40)
    assert first == list(range(1, 41))
    allocator.free(first)
    again = allocator.alloc(40)
    assert again == sorted(again) and again[-1] - again[0] == 39  # one run, not 40 single slots


def test_request_blocks_coalesce_runs_on_both_sides():
    # one rank each side: one KV head of 8 bytes, one GDN key head (q and k: 4 + 4 conv bytes), one value head
    # (8 conv bytes, 32 recurrent-state bytes)
    whole = HeadRange(0, 1)
    shard = PoolShard(whole, True, whole, whole, 8, 4, 8, 32)
    src = PoolLayout("a:1", [(1000, 5000, 8)], [(9000, 16, 9500, 32)], (0, 32), (0, 0), shard)
    dst = PoolLayout("b:2", [(2000, 6000, 8)], [(7000, 16, 7500, 32)], (0, 32), (0, 0), shard)
    sources, targets, lengths = request_blocks(src, dst, [3, 4, 5, 9], [10, 11, 12, 13], 2, 5)
    # K of the run 3-5 -> 10-12 and of slot 9 -> 13, the same for V, then the conv row (q, k and v parts merge)
    # and the recurrent state of the state slots
    assert sources == [1024, 1072, 5024, 5072, 9032, 9564]
    assert targets == [2080, 2104, 6080, 6104, 7080, 7660]
    assert lengths == [24, 8, 24, 8, 16, 32]


class RecordingEngine:
    def __init__(self) -> None:
        self.batches: list[int] = []

    def batch_transfer_sync_write(self, session, sources, targets, lengths) -> int:
        assert len(sources) == len(targets) == len(lengths)
        self.batches.append(len(sources))
        return 0


def test_large_transfers_are_split_into_accepted_batches():
    transfer = MooncakeTransfer.__new__(
        MooncakeTransfer
    )  # the batching logic only, no engine to start
    transfer.engine, transfer.stats = RecordingEngine(), TransferStats()
    n = 2 * MAX_BATCH_BLOCKS + 7
    assert transfer.write("peer:1", list(range(n)), list(range(n)), [4] * n) == 4 * n
    assert transfer.engine.batches == [MAX_BATCH_BLOCKS, MAX_BATCH_BLOCKS, 7]
