"""GDN state snapshots as a cached resource of their own: evicted least recently used from any node (the node keeps
its KV), sized from memory, reported in the loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import sglang_lite
from sglang_lite.config import ModelConfig
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.mem_cache.radix_cache import RadixCache
from sglang_lite.runtime.memory import resolve_max_total_tokens, resolve_state_snapshots
from sglang_lite.server_args import ServerArgs

TINY = Path(sglang_lite.__file__).parent / "assets" / "tiny_qwen3_5_moe"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def cache_with(num_snapshots: int, page_size: int = 1) -> tuple[RadixCache, ModelPools]:
    pools = ModelPools.create(
        ModelConfig.from_hf(TINY), 256, 2, 64, torch.float32, "cpu", num_snapshots, page_size
    )
    return RadixCache(pools, pools.states.snapshots, clock=Clock()), pools


def insert(cache: RadixCache, pools: ModelPools, tokens: list[int], slot: int = 1):
    """Caches ``tokens`` with fresh KV pages (a request's, released right after) and a snapshot of state slot
    ``slot``; the node ending the prefix's whole pages."""
    size = pools.page_size
    pages = pools.kv.allocator.alloc(-(-len(tokens) // size))
    node, _, duplicates = cache.insert(tokens, pages, slot)
    pools.kv.allocator.free(duplicates + pages[len(tokens) // size :])
    return node


def test_a_new_snapshot_frees_the_least_recently_used_one_and_its_node_keeps_the_kv():
    cache, pools = cache_with(2)
    inner = insert(cache, pools, list(range(10)))  # an earlier turn
    insert(cache, pools, list(range(10)) + [50, 51, 52])  # its next turn, below it
    cache.match(list(range(10)) + [50, 51, 52], 13)  # touches both: the inner node is older
    insert(cache, pools, [90, 91, 92, 93])  # a third snapshot: the inner node's goes
    assert inner.snapshot is None and cache.snapshots_evicted == 1
    assert cache.num_tokens == 17  # every token's KV stays
    assert cache.match(list(range(10)) + [7], 10)[0] == 0  # no snapshot ends there any more
    hit = cache.match(list(range(10)) + [50, 51, 52, 60], 13)
    # through the inner node's KV
    assert hit.length == 13 and hit.node.snapshot is not None and len(hit.pages) == 13


def test_kv_eviction_takes_leaves_without_a_snapshot_first():
    cache, pools = cache_with(1)
    bare = insert(cache, pools, [1, 2, 3, 4])
    insert(
        cache, pools, [7, 8, 9]
    )  # takes the only snapshot slot: [1..4] keeps its KV, no snapshot
    assert bare.snapshot is None
    cache.match([1, 2, 3, 4, 5], 4)  # the snapshot-less leaf is now the most recently used
    assert bare.last_access > cache.root.children[(7,)].last_access
    free = pools.kv.allocator.num_free
    cache.evict(
        free + 1
    )  # one more slot: the snapshot-less leaf goes first, though it is not the oldest
    assert cache.match([7, 8, 9, 10], 3)[0] == 3
    assert cache.num_tokens == 3


def test_the_snapshot_pool_is_sized_from_memory():
    config = ModelConfig.from_hf(TINY)
    args = ServerArgs(max_running_requests=4, max_total_tokens=32768)
    tokens = resolve_max_total_tokens(args, config, torch.float32, 4096)
    per_token = ModelPools.bytes_per_token(config, torch.float32)
    per_slot = ModelPools.bytes_per_request_state(config, torch.float32)
    expected = int(0.9 * tokens * per_token) // per_slot - 4
    assert resolve_state_snapshots(args, config, torch.float32, tokens) == expected > 4
    fixed = ServerArgs(max_running_requests=4, max_mamba_cache_size=20)
    assert resolve_state_snapshots(fixed, config, torch.float32, tokens) == 16
    small = ServerArgs(max_running_requests=4, max_total_tokens=64)
    assert (
        resolve_state_snapshots(small, config, torch.float32, 64) == 4
    )  # one per running request at least
    off = ServerArgs(max_running_requests=4, disable_radix_cache=True)
    assert resolve_state_snapshots(off, config, torch.float32, tokens) == 0


def test_state_pool_flags_are_checked():
    with pytest.raises(
        ValueError, match="max_mamba_cache_size .4. must exceed max_running_requests"
    ):
        ServerArgs(max_running_requests=4, max_mamba_cache_size=4)
    with pytest.raises(ValueError, match="mamba_full_memory_ratio must be >= 0"):
        ServerArgs(mamba_full_memory_ratio=-1.0)


def test_a_prefix_ending_inside_a_page_is_a_tail_with_a_copy_of_its_kv():
    """Pages of 4: a 10-token prefix is two whole pages and a tail of 2 tokens with its own page (a copy of the
    request's KV there); a match reaches the tail's last token, and evicting its snapshot frees its page."""
    cache, pools = cache_with(2, page_size=4)
    pools.kv.buffer.copy_(torch.randn(pools.kv.buffer.shape))
    request = pools.kv.allocator.alloc(3)
    node, path, duplicates = cache.insert(list(range(10)), request, 1)
    assert path == request[:2] and not duplicates and len(node.tokens) == 8
    (tail,) = node.tails.values()
    assert tail.tokens == [8, 9] and tail.snapshot is not None and tail.pages != request[2:]
    copied = pools.kv.buffer[tail.pages[0] * 4 : tail.pages[0] * 4 + 2]
    assert torch.equal(copied, pools.kv.buffer[request[2] * 4 : request[2] * 4 + 2])
    pools.kv.allocator.free(
        request[2:]
    )  # the request ends: its own page goes, the tail's copy stays
    hit = cache.match(list(range(10)) + [77], 10)
    assert (hit.length, hit.node, hit.pages, hit.tail) == (10, node, request[:2], tail)
    assert (
        cache.match(list(range(10)), 9).length == 0
    )  # the tail ends past max_len; no snapshot at 8
    assert cache.num_tokens == 12  # two whole pages and the tail's
    assert cache.evict_snapshot() and not node.tails
    assert cache.num_tokens == 8 and pools.kv.allocator.num_used == 2
    assert cache.flush() == 8 and pools.kv.allocator.num_used == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_the_snapshot_freed_is_the_least_recently_used_in_the_trees_order(page_size):
    """``evict_snapshot`` finds its victim among the nodes holding a snapshot (an index kept beside the tree): the
    node a walk of the whole tree would pick (least recently used; of nodes read at one clock reading, the first
    in the walk), over random turns that share prefixes, with tails, matches and evictions; the index stays the
    tree's (``check``)."""
    cache, pools = cache_with(6, page_size)
    gen = torch.Generator().manual_seed(page_size)
    stems = [torch.randint(0, 200, (12,), generator=gen).tolist() for _ in range(3)]
    for turn in range(60):
        stem = stems[turn % 3]
        tokens = stem[: 4 + turn % 9] + torch.randint(0, 200, (turn % 5,), generator=gen).tolist()
        if turn % 4 == 3:
            cache.match(tokens, len(tokens))
        elif turn % 7 == 6:
            held = [n for n in cache._nodes() if n.snapshot is not None]
            victim = min(held, key=lambda n: n.last_access)
            assert cache.evict_snapshot()
            assert victim.snapshot is None or victim not in cache._nodes()
        else:
            insert(cache, pools, tokens)
        cache.check()
    assert cache.snapshots_evicted > 5
