"""RequestMemory, the one owner of what requests hold: every allocation is recorded where a forward reads it, and
every release gives back exactly what was taken, with the listeners told each time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import sglang_lite
from sglang_lite.config import ModelConfig
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.mem_cache.radix_cache import RadixCache
from sglang_lite.mem_cache.request_memory import Holding, RequestMemory

TINY = Path(sglang_lite.__file__).parent / "assets" / "tiny_qwen3_5_moe"


class Listener:
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def on_admit(self, holder) -> None:
        self.events.append(("admit", holder.req_row))

    def on_release(self, holder) -> None:
        self.events.append(("release", holder.req_row))


@pytest.fixture
def pools() -> ModelPools:
    config = ModelConfig.from_hf(TINY)
    return ModelPools.create(config, 64, 3, 32, torch.float32, "cpu", num_snapshots=3)


def test_kv_slots_are_recorded_in_the_row_and_given_back_on_release(pools):
    listener = Listener()
    memory = RequestMemory(pools, listeners=(listener,))
    holder = Holding(list(range(1, 11)))
    assert memory.admit(holder)
    first = memory.alloc_kv([holder], [6])
    holder.num_computed = 6
    more = memory.alloc_kv([holder], [4])
    holder.num_computed = 10
    assert memory.slots_of(holder, 10) == first + more
    memory.check([holder])
    row = holder.req_row
    memory.release(holder)
    memory.check([])
    assert listener.events == [("admit", row), ("release", row)]
    assert holder.req_row is None and holder.num_computed == 0


def test_a_failed_forward_gives_its_slots_back(pools):
    memory = RequestMemory(pools)
    holder = Holding([1, 2, 3])
    memory.admit(holder)
    slots = memory.alloc_kv([holder], [3])
    memory.free_kv(slots)  # the forward raised: nothing was computed
    memory.check([holder])
    memory.release(holder, cache=False)
    memory.check([])


def test_alloc_kv_names_the_shortage_and_takes_nothing():
    pools = ModelPools.create(ModelConfig.from_hf(TINY), 40, 3, 32, torch.float32, "cpu")
    memory = RequestMemory(pools)
    holders = [Holding([1] * 30), Holding([2] * 30)]
    for holder in holders:
        memory.admit(holder)
    memory.alloc_kv([holders[0]], [30])
    holders[0].num_computed = 30
    free = pools.kv.allocator.num_free
    with pytest.raises(MemoryError, match=f"KV pool has {free} free slots, 30 needed"):
        memory.alloc_kv([holders[1]], [30])
    memory.check(holders)


def test_reserve_takes_all_or_nothing(pools):
    memory = RequestMemory(pools)
    holder = Holding([5] * 20)
    assert memory.reserve(holder, 70) is None
    assert holder.req_row is None and memory.free_rows == 3
    slots = memory.reserve(holder, 20)
    assert len(slots) == 20 and holder.num_computed == 20
    memory.check([holder])


def test_a_parallel_sample_shares_the_cached_prompt_and_copies_the_rest(pools):
    memory = RequestMemory(pools, RadixCache(pools, pools.states.snapshots))
    parent = Holding(list(range(1, 13)))
    memory.admit(parent)
    memory.alloc_kv([parent], [12])
    parent.num_computed = 12
    memory.cache_prefix(parent)
    assert parent.cache_owned_len == 12
    child = Holding(list(parent.tokens))
    assert memory.share_prompt(parent, child)
    assert memory.slots_of(child, 12) == memory.slots_of(parent, 12)
    assert child.cache_owned_len == 12 and child.num_computed == 12
    memory.check([parent, child])
    for holder in (parent, child):
        memory.release(holder)
    memory.check([])
    assert memory.flush_cache() == 12
    memory.check([])


def test_a_new_holder_reuses_a_cached_prefix(pools):
    memory = RequestMemory(pools, RadixCache(pools, pools.states.snapshots))
    first = Holding(list(range(1, 17)))
    memory.admit(first)
    memory.alloc_kv([first], [16])
    first.num_computed = 16
    memory.release(first)  # cached on the way out
    again = Holding(list(range(1, 17)) + [99])
    memory.admit(again)
    assert memory.reuse_prefix(again, 16) == 16
    assert again.num_computed == again.cache_owned_len == 16
    memory.check([again])
