"""RequestMemory, the one owner of what requests hold: every allocation is recorded where a forward reads it, and
every release gives back exactly what was taken, with the listeners told each time. Over pages of one token and of
an awkward size (5): a holder's positions fill its pages in order, the prefix cache owns whole pages, and what a
holder reads from the cache or a parent holds the same keys and values as the original."""

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
PAGE_SIZES = [1, 5]


class Listener:
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def on_admit(self, holder) -> None:
        self.events.append(("admit", holder.req_row))

    def on_release(self, holder) -> None:
        self.events.append(("release", holder.req_row))


def make_pools(page_size: int, tokens: int = 64, snapshots: int = 3) -> ModelPools:
    config = ModelConfig.from_hf(TINY)
    return ModelPools.create(config, tokens, 3, 40, torch.float32, "cpu", snapshots, page_size)


def computed(memory: RequestMemory, holder: Holding, count: int) -> list[int]:
    """Allocates ``count`` more positions and writes distinct keys and values there, as a forward would."""
    slots = memory.alloc_kv([holder], [count])
    holder.num_computed += count
    pool = memory.pools.kv.buffer
    pool[torch.tensor(slots)] = torch.randn(len(slots), *pool.shape[1:])
    return slots


def kv_of(memory: RequestMemory, holder: Holding, end: int) -> torch.Tensor:
    return memory.pools.kv.buffer[torch.tensor(memory.slots_of(holder, end))]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_kv_slots_fill_the_rows_pages_in_order_and_are_given_back_on_release(page_size):
    pools = make_pools(page_size)
    listener = Listener()
    memory = RequestMemory(pools, listeners=(listener,))
    holder = Holding(list(range(1, 11)))
    assert memory.admit(holder)
    first = computed(memory, holder, 6)
    more = computed(memory, holder, 4)
    slots = memory.slots_of(holder, 10)
    assert slots == first + more
    # position p sits at offset p % page_size of its page, and the pages came as one run
    assert [s % page_size for s in slots] == [p % page_size for p in range(10)]
    assert slots == list(range(slots[0], slots[0] + 10))
    assert pools.kv.allocator.num_used == -(-10 // page_size)
    memory.check([holder])
    row = holder.req_row
    memory.release(holder)
    memory.check([])
    assert listener.events == [("admit", row), ("release", row)]
    assert holder.req_row is None and holder.num_computed == 0


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_a_failed_forward_gives_back_only_its_new_pages(page_size):
    memory = RequestMemory(make_pools(page_size))
    holder = Holding(list(range(20)))
    memory.admit(holder)
    computed(memory, holder, 7)
    before = kv_of(memory, holder, 7)
    slots = memory.alloc_kv([holder], [9])
    memory.free_kv(slots)  # the forward raised: nothing was computed
    memory.check([holder])  # the page holding positions 5 and 6 is still the holder's
    assert torch.equal(kv_of(memory, holder, 7), before)
    memory.release(holder, cache=False)
    memory.check([])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_the_tail_of_a_holders_positions_can_be_given_back(page_size):
    """What a speculative decoder does with rejected draft tokens: it frees their slots and keeps the rest."""
    memory = RequestMemory(make_pools(page_size))
    holder = Holding(list(range(30)))
    memory.admit(holder)
    computed(memory, holder, 11)
    draft = computed(memory, holder, 7)  # positions 11..17
    kept = kv_of(memory, holder, 13)
    memory.free_kv(draft[2:])  # positions 13..17 rejected
    holder.num_computed = 13
    memory.check([holder])
    assert torch.equal(kv_of(memory, holder, 13), kept)
    computed(memory, holder, 5)  # decoding goes on over the freed positions
    memory.check([holder])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_alloc_kv_names_the_shortage_and_takes_nothing(page_size):
    memory = RequestMemory(make_pools(page_size, tokens=40, snapshots=0))
    holders = [Holding([1] * 30), Holding([2] * 30)]
    for holder in holders:
        memory.admit(holder)
    computed(memory, holders[0], 30)
    free = memory.free_pages
    with pytest.raises(
        MemoryError, match=f"KV pool has {free} free pages of {page_size} tokens, {30 // page_size}"
    ):
        memory.alloc_kv([holders[1]], [30])
    memory.check(holders)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_reserve_takes_all_or_nothing_in_one_run(page_size):
    memory = RequestMemory(make_pools(page_size))
    holder = Holding([5] * 20)
    assert memory.reserve(holder, 70) is None
    assert holder.req_row is None and memory.free_rows == 3
    pages = memory.reserve(holder, 20)
    assert pages == list(range(pages[0], pages[0] + -(-20 // page_size)))
    assert holder.num_computed == 20
    memory.check([holder])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_a_parallel_sample_shares_the_cached_pages_and_copies_the_rest(page_size):
    pools = make_pools(page_size)
    memory = RequestMemory(pools, RadixCache(pools, pools.states.snapshots))
    parent = Holding(list(range(1, 13)))
    memory.admit(parent)
    computed(memory, parent, 12)
    memory.cache_prefix(parent)
    shared = 12 // page_size * page_size
    assert parent.cache_owned_len == shared
    child = Holding(list(parent.tokens))
    assert memory.share_prompt(parent, child)
    assert memory.slots_of(child, shared) == memory.slots_of(parent, shared)
    assert torch.equal(kv_of(memory, child, 12), kv_of(memory, parent, 12))
    assert child.cache_owned_len == shared and child.num_computed == 12
    memory.check([parent, child])
    for holder in (parent, child):
        memory.release(holder)
    memory.check([])
    memory.flush_cache()
    assert pools.kv.allocator.num_used == 0
    memory.check([])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_a_new_holder_reuses_a_cached_prefix_to_the_token(page_size):
    pools = make_pools(page_size)
    memory = RequestMemory(pools, RadixCache(pools, pools.states.snapshots))
    first = Holding(list(range(1, 17)))
    memory.admit(first)
    computed(memory, first, 16)
    original = kv_of(memory, first, 16)
    memory.release(first)  # cached on the way out
    again = Holding(list(range(1, 17)) + [99])
    memory.admit(again)
    assert memory.reuse_prefix(again, 16) == 16
    assert again.num_computed == 16 and again.cache_owned_len == 16 // page_size * page_size
    assert torch.equal(kv_of(memory, again, 16), original)
    memory.check([again])
    computed(memory, again, 1)  # it writes after the hit in a page of its own
    assert torch.equal(kv_of(memory, again, 16), original)
    memory.release(again)
    memory.check([])
