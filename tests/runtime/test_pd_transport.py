"""PD transport pieces without a second server: KV pages come in runs, runs on both sides become few blocks (KV and
states alike, whatever the page sizes of the two sides), a transfer of many blocks keeps as many under way as the
TCP transport accepts and fails only once none is, and the transfer figures are moving averages and histograms."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import sglang_lite
from sglang_lite.config import ModelConfig
from sglang_lite.mem_cache.allocator import PageAllocator
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.pd_transport import transfer as transfer_module
from sglang_lite.pd_transport.layout import (
    HeadRange,
    PoolLayout,
    PoolShard,
    Region,
    request_blocks,
    slot_runs,
)
from sglang_lite.pd_transport.transfer import (
    ENGINE_SYNC_TIMEOUT_S,
    LATENCY_BUCKETS_S,
    MAX_BATCH_BLOCKS,
    PROBE_INTERVAL_S,
    RECENT_TRANSFERS,
    MooncakeTransfer,
    PeerDown,
    TransferError,
    TransferStats,
)

TINY = Path(sglang_lite.__file__).parent / "assets" / "tiny_qwen3_5_moe"


def test_pages_come_in_runs_and_a_growing_request_keeps_its_run():
    allocator = PageAllocator(64, "kv")
    first = allocator.alloc(10)
    assert first == list(range(1, 11))
    other = allocator.alloc(3)
    allocator.free(first[2:6])  # a hole of 4 pages
    assert allocator.alloc(5) == list(range(14, 19))  # the first run long enough, not the hole
    assert allocator.alloc(2, after=other[-1]) == [3, 4]  # busy after 13: the first fit, the hole
    assert allocator.alloc(2, after=4) == [5, 6]  # right after page 4, where that request grows
    assert allocator.alloc(1, after=18) == [19]
    assert allocator.alloc(1, after=13) == [20]  # 14 is taken: the lowest free page


def test_a_fragmented_pool_gives_the_fewest_runs():
    allocator = PageAllocator(12, "kv")
    allocator.alloc(12)
    allocator.free([2, 3, 5, 8, 9, 10])  # runs of 2, 1 and 3
    pages = allocator.alloc(5)
    assert pages == [2, 3, 8, 9, 10]  # the two longest runs
    assert allocator.num_free == 1 and allocator.alloc(2) is None and allocator.num_free == 1


def test_slot_runs_follow_pages_on_both_sides():
    # 10 positions; pages of 4 on one side (pages 5, 6, 9) and of 2 on the other (pages 20-24)
    runs = slot_runs([5, 6, 9], 4, [20, 21, 22, 23, 24], 2, 10)
    assert runs == [(20, 40, 8), (36, 48, 2)]  # pages 5-6 are adjacent, 9 is not
    assert slot_runs([3, 4, 5], 1, [7, 8, 10], 1, 3) == [(3, 7, 2), (5, 10, 1)]


# one rank of one on each side: one layer of each kind, one KV head of 4 bytes (K and V: 8 bytes a slot), one GDN
# key head (q and k: 4 + 4 conv bytes) and one value head (8 conv bytes: a 16-byte conv row)
ONE = HeadRange(0, 1)
WHOLE = PoolShard(ONE, True, ONE, ONE, 4, 4, 8, 32, attention_layers=1, gdn_layers=1)


def layout(session: str, page_size: int, kv: list[Region], states: list[Region]) -> PoolLayout:
    return PoolLayout(session, page_size, kv, states, (0, 32), (0, 0), WHOLE)


def test_request_blocks_write_a_run_and_each_state_kind_as_one_block():
    src = layout("a:1", 4, [Region(1000, 8, 8)], [Region(9000, 16, 16)])
    dst = layout("b:2", 4, [Region(2000, 8, 8)], [Region(7000, 16, 16)])
    sources, targets, lengths = request_blocks(src, dst, [1, 2, 7], [3, 4, 5], 10, 2, 5)
    # positions 0-7 in pages 1-2 -> 3-4 (one run), 8-9 in page 7 -> 5, then the state slot 2 -> 5
    assert sources == [1000 + 4 * 8, 1000 + 28 * 8, 9000 + 2 * 16]
    assert targets == [2000 + 12 * 8, 2000 + 20 * 8, 7000 + 5 * 16]
    assert lengths == [8 * 8, 2 * 8, 16]


def test_a_region_holding_part_of_each_slot_is_written_slot_by_slot():
    """A region whose rows are a part of each slot's bytes (row < stride) is not contiguous over a run."""
    src = layout("a:1", 1, [Region(1000, 32, 8)], [])
    dst = layout("b:2", 1, [Region(2000, 32, 8)], [])
    assert request_blocks(src, dst, [4, 5], [9, 10], 2, 0, 0) == (
        [1000 + 4 * 32, 1000 + 5 * 32],
        [2000 + 9 * 32, 2000 + 10 * 32],
        [8, 8],
    )


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_pools_layout_gives_one_kv_block_per_run_and_two_state_blocks(page_size):
    """The real pools: every layer's K and V of a slot are one region, every GDN layer's conv states of a state
    slot one, the recurrent states another; a request on one run of pages moves as three blocks."""
    config = ModelConfig.from_hf(TINY)
    pools = ModelPools.create(config, 256, 2, 128, torch.float32, "cpu", page_size=page_size)
    meta, extras = torch.zeros(3, 4, dtype=torch.int64), torch.zeros(8, dtype=torch.uint8)
    shard = PoolShard.of(config, 0, 1, torch.float32)
    pool_layout = PoolLayout.of("a:1", pools, meta, extras, shard)
    assert PoolLayout.from_dict(pool_layout.to_dict()) == pool_layout
    assert [r.row for r in pool_layout.kv] == [ModelPools.bytes_per_token(config, torch.float32)]
    state_bytes = sum(r.row for r in pool_layout.states)
    assert state_bytes == ModelPools.bytes_per_request_state(config, torch.float32)
    pages = pools.kv.allocator.alloc(-(-100 // page_size))
    blocks = request_blocks(pool_layout, pool_layout, pages, pages, 100, 1, 2)
    assert len(blocks[0]) == 3 and sum(blocks[2]) == 100 * pool_layout.kv[0].row + state_bytes


class RecordingEngine:
    """The engine's one-block submit and its status check: a block ends on its second check (``fail``: those
    blocks fail)."""

    def __init__(self, fail: frozenset[int] = frozenset()) -> None:
        self.fail = fail
        self.submitted: list[int] = []  # sources, in order
        self.checks: dict[int, int] = {}  # batch -> checks so far, while under way
        self.most_underway = 0
        self.batches: list[int] = []  # sizes of synchronous batches

    def batch_transfer_sync_write(self, session, sources, targets, lengths) -> int:
        assert len(sources) == len(targets) == len(lengths)
        self.batches.append(len(sources))
        return 0

    def send_probe(self, session) -> int:
        return 0  # the peer answers

    def transfer_submit_write(self, session, source, target, length) -> int:
        self.submitted.append(source)
        batch = len(self.submitted)
        self.checks[batch] = 0
        self.most_underway = max(self.most_underway, len(self.checks))
        return batch

    def transfer_check_status(self, batch) -> int:
        self.checks[batch] += 1
        if self.checks[batch] < 2:
            return 0
        del self.checks[batch]
        return -1 if self.submitted[batch - 1] in self.fail else 1


def engine_only(engine: RecordingEngine, poll: bool = True) -> MooncakeTransfer:
    # the submitting and waiting only, no engine to start
    return MooncakeTransfer(engine, "me:1", poll)


def test_synchronous_writes_go_in_batches_the_transport_accepts():
    engine = RecordingEngine()
    n = 2 * MAX_BATCH_BLOCKS + 7
    assert engine_only(engine, poll=False).write("p:1", list(range(n)), [0] * n, [4] * n) == 4 * n
    assert engine.batches == [MAX_BATCH_BLOCKS, MAX_BATCH_BLOCKS, 7] and not engine.submitted
    engine_only(engine, poll=False).write("p:1", [1, 2, 3], [4, 5, 6], [8, 8, 8])
    assert engine.batches[-1] == 3  # a request's few blocks: one batch


def test_large_transfers_keep_an_accepted_number_of_blocks_under_way():
    engine = RecordingEngine()
    n = 2 * MAX_BATCH_BLOCKS + 7
    assert engine_only(engine).write("peer:1", list(range(n)), list(range(n)), [4] * n) == 4 * n
    assert engine.submitted == list(range(n)) and not engine.checks
    assert engine.most_underway == MAX_BATCH_BLOCKS
    small = RecordingEngine()
    engine_only(small).write("peer:1", [1, 2, 3], [4, 5, 6], [8, 8, 8])
    assert small.most_underway == 3  # a request's few blocks: all under way at once


def test_a_failed_block_fails_the_write_once_nothing_is_under_way():
    engine = RecordingEngine(fail=frozenset({1}))
    with pytest.raises(TransferError, match="block 1 failed"):
        engine_only(engine).write("peer:1", [0, 1, 2], [0, 1, 2], [4, 4, 4])
    # every block that went out ended before the error: none writes into reused pages
    assert not engine.checks
    n = MAX_BATCH_BLOCKS + 5
    engine = RecordingEngine(fail=frozenset({0}))
    with pytest.raises(TransferError, match="block 0 failed"):
        engine_only(engine).write("peer:1", list(range(n)), list(range(n)), [4] * n)
    # no block sent after the failure
    assert len(engine.submitted) == MAX_BATCH_BLOCKS and not engine.checks


class SlowEngine(RecordingEngine):
    """Blocks that end on their ``ends_on``-th status check (each check takes a second of ``clock``), the
    engine's probe answering ``probe``, and a synchronous write that fails after ``sync_seconds``."""

    def __init__(
        self, clock: FakeClock, ends_on: int, probe: int = 0, sync_seconds: float = 0
    ) -> None:
        super().__init__()
        self.clock, self.ends_on, self.probe, self.sync_seconds = (
            clock,
            ends_on,
            probe,
            sync_seconds,
        )
        self.probes = 0

    def transfer_check_status(self, batch) -> int:
        self.clock.now += 1.0
        if batch not in self.checks:
            return 1
        self.checks[batch] += 1
        if self.checks[batch] < self.ends_on:
            return 0
        del self.checks[batch]
        return -1 if self.submitted[batch - 1] in self.fail else 1

    def batch_transfer_sync_write(self, session, sources, targets, lengths) -> int:
        self.clock.now += self.sync_seconds
        return -1

    def send_probe(self, session) -> int:
        self.probes += 1
        return self.probe


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        pass


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(transfer_module, "time", fake)
    return fake


def test_a_timed_out_block_is_waited_for_and_then_fails_settled(clock: FakeClock):
    # the deadline passes at the 3rd check; the block ends on its 5th, before twice the deadline
    engine = SlowEngine(clock, ends_on=5)
    with pytest.raises(TransferError, match="block 0 timed out") as failure:
        MooncakeTransfer(engine, "me:1", True, write_timeout_s=2.5).write("peer:1", [1], [2], [8])
    assert failure.value.settled and not failure.value.underway
    assert (
        not engine.checks
    )  # nothing under way when the failure is reported: it can no longer land


def test_a_block_still_under_way_at_twice_the_deadline_fails_unsettled(clock: FakeClock):
    engine = SlowEngine(clock, ends_on=100)
    transfer = MooncakeTransfer(engine, "me:1", True, write_timeout_s=2.5)
    with pytest.raises(TransferError, match="still under way") as failure:
        transfer.write("peer:1", [1, 2], [3, 4], [8, 8])
    error = failure.value
    assert not error.settled and sorted(error.underway) == sorted(engine.checks)
    assert (
        transfer.underway(error.underway) == error.underway
    )  # followed until the engine ends them
    for _ in range(100):
        transfer.underway(error.underway)
    assert transfer.underway(error.underway) == ()


def test_a_peer_that_failed_is_refused_at_once_until_it_answers_a_probe(clock: FakeClock):
    engine = SlowEngine(clock, ends_on=2)
    engine.fail = frozenset({1, 7})
    transfer = MooncakeTransfer(engine, "me:1", True)
    with pytest.raises(
        TransferError, match="block 0 failed"
    ):  # a refused block, the peer answers: not down
        transfer.write("peer:1", [7], [2], [8])
    assert not transfer.is_down("peer:1") and engine.probes == 1
    engine.probe = -102  # the peer is gone: its failed block marks it down
    with pytest.raises(TransferError, match="block 0 failed"):
        transfer.write("peer:1", [1], [2], [8])
    assert transfer.is_down("peer:1") and not transfer.is_down("other:1")
    engine.probes = 0
    submitted = len(engine.submitted)
    with pytest.raises(PeerDown):  # no probe before PROBE_INTERVAL_S, nothing submitted
        transfer.write("peer:1", [3], [4], [8])
    assert engine.probes == 0 and len(engine.submitted) == submitted
    assert transfer.write("other:1", [3], [4], [8]) == 8  # other peers are not held up
    clock.now += PROBE_INTERVAL_S
    engine.probe = -102  # still unreachable: refused, probed once
    with pytest.raises(PeerDown):
        transfer.write("peer:1", [3], [4], [8])
    assert engine.probes == 1
    clock.now += PROBE_INTERVAL_S
    engine.probe = 0  # back
    assert transfer.write("peer:1", [5], [6], [8]) == 8 and not transfer.is_down("peer:1")


def test_a_synchronous_write_that_failed_past_the_engines_deadline_is_unsettled(clock: FakeClock):
    quick = SlowEngine(clock, ends_on=2, sync_seconds=0.5)
    with pytest.raises(TransferError) as failure:
        MooncakeTransfer(quick, "me:1", False).write("peer:1", [1], [2], [8])
    assert failure.value.settled  # failed before the engine's deadline: its blocks ended
    slow = SlowEngine(clock, ends_on=2, sync_seconds=ENGINE_SYNC_TIMEOUT_S + 1)
    with pytest.raises(TransferError) as failure:
        MooncakeTransfer(slow, "me:1", False).write("peer:1", [1], [2], [8])
    # the engine gave up on blocks it may still be sending: the memory is held as long again
    assert not failure.value.settled
    assert failure.value.settle_by == clock.now + ENGINE_SYNC_TIMEOUT_S + 1


def test_transfer_figures_are_moving_averages_and_histograms():
    stats = TransferStats()
    stats.record(1_000_000, 0.5)  # an old slow one
    for _ in range(RECENT_TRANSFERS):
        stats.record(2_000_000, 0.001)
    assert stats.latency_ms == pytest.approx(1.0)
    assert stats.speed_gb_s == pytest.approx(2.0)
    assert stats.transfers == RECENT_TRANSFERS + 1
    assert stats.seconds == pytest.approx(0.5 + RECENT_TRANSFERS * 0.001)
    assert sum(stats.latency_counts) == sum(stats.size_counts) == stats.transfers
    assert stats.latency_counts[LATENCY_BUCKETS_S.index(0.001)] == RECENT_TRANSFERS


def test_metrics_render_the_transfer_histograms_of_each_rank():
    from sglang_lite.server.metrics import ServerMetrics

    stats = TransferStats()
    for seconds, nbytes in ((0.0008, 500_000), (0.004, 600_000), (0.2, 3_000_000)):
        stats.record(nbytes, seconds)
    pd = {
        "kv_transfer_latency_counts": stats.latency_counts,
        "kv_transfer_size_counts": stats.size_counts,
        "kv_transfer_seconds_total": stats.seconds,
        "kv_transfer_bytes_total": stats.bytes,
    }
    load = {"dp_rank": 1, "disaggregation": pd}
    idle = {
        "dp_rank": 0,
        "disaggregation": {"kv_transfer_latency_counts": [], "kv_transfer_size_counts": []},
    }
    text = ServerMetrics()._histograms([idle, load])
    name = "sglang_lite_kv_transfer_latency_seconds"
    assert f'{name}_bucket{{dp_rank="1",le="0.001"}} 1' in text
    assert f'{name}_bucket{{dp_rank="1",le="0.005"}} 2' in text
    assert f'{name}_bucket{{dp_rank="1",le="+Inf"}} 3' in text
    assert f'{name}_count{{dp_rank="1"}} 3' in text and 'dp_rank="0"' not in text
    size = "sglang_lite_kv_transfer_size_bytes"
    assert f'{size}_bucket{{dp_rank="1",le="{2**20}"}} 2' in text
    assert f'{size}_sum{{dp_rank="1"}} 4100000' in text
