"""The one owner of what requests hold in the pools: a row of ``req_to_token``, a linear-attention state slot,
the KV pages of their computed positions (recorded in the row's page table), and what they hand to the prefix
cache.

Every allocation and every release of request memory happens here, for the scheduler, both PD sides, parallel
samples and ``generate.py``. KV comes in pages of ``page_size`` positions: a holder's positions fill its pages in
order, and the prefix cache owns whole pages only (``cache_owned_len`` is a page boundary). A holder (a scheduler
``Req``, or a ``Holding`` for callers without one) says what it holds in five fields; this class keeps them and
the pools in step:

- ``admit`` gives a holder a row and a state slot; ``reserve`` also the KV of a prompt that another server
  computes (the PD decode side).
- ``alloc_kv`` takes KV slots for the next tokens of a batch before it is built (new pages as needed); a failed
  forward gives them back with ``free_kv``, which also frees the tail of a holder's positions.
- ``reuse_prefix`` / ``cache_prefix``: the prefix cache's KV read in place and a snapshot of the state after it;
  ``share_prompt`` gives a parallel sample its parent's prompt.
- ``release`` frees it all, caching what was computed first when asked to.

Listeners (the sampler's per-row state, the admission order) hear of each admission and release, so no path can
skip one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.mem_cache.radix_cache import Hit, RadixCache


class MemoryHolder(Protocol):
    """What a request holds; ``fill_ids`` are its tokens, in the order of its positions."""

    req_row: int | None
    state_slot: int | None
    num_computed: int  # positions whose KV (and the state after them) are in the pools
    cache_owned_len: int  # the first positions, whose KV the prefix cache owns
    cache_node: Any  # the prefix-cache node it holds locked

    @property
    def fill_ids(self) -> list[int]: ...


@dataclass(eq=False)
class Holding:
    """A holder for callers without requests of their own (``generate.py``)."""

    tokens: list[int]
    req_row: int | None = None
    state_slot: int | None = None
    num_computed: int = 0
    cache_owned_len: int = 0
    cache_node: Any = None

    @property
    def fill_ids(self) -> list[int]:
        return self.tokens


class MemoryListener(Protocol):
    def on_admit(self, holder: Any) -> None: ...

    def on_release(self, holder: Any) -> None: ...


class RequestMemory:
    def __init__(
        self,
        pools: ModelPools,
        cache: RadixCache | None = None,
        listeners: tuple[MemoryListener, ...] = (),
    ) -> None:
        self.pools = pools
        self.cache = cache  # the prefix cache, or None (``--disable-radix-cache``)
        self.listeners = listeners
        self.page_size = pools.page_size

    # ---- what is free -----------------------------------------------------------------------------------------
    @property
    def free_rows(self) -> int:
        """Requests that can still be admitted (each needs a row and a state slot)."""
        return min(self.pools.req_to_token.allocator.num_free, self.pools.states.allocator.num_free)

    @property
    def free_pages(self) -> int:
        """KV pages free now (unused cached prefixes not counted)."""
        return self.pools.kv.allocator.num_free

    @property
    def free_tokens(self) -> int:
        """KV slots in the free pages."""
        return self.free_pages * self.page_size

    @property
    def kv_free(self) -> int:
        """KV slots free now, counting the unused cached prefixes that eviction would free."""
        return self.free_tokens + self.evictable_tokens

    @property
    def used_tokens(self) -> int:
        """KV slots in pages that requests hold (unused cached prefixes count as free, as upstream counts them)."""
        return self.pools.kv.allocator.num_used * self.page_size - self.evictable_tokens

    @property
    def evictable_tokens(self) -> int:
        return self.cache.evictable_tokens if self.cache is not None else 0

    @property
    def cached_tokens(self) -> int:
        return self.cache.num_tokens if self.cache is not None else 0

    def page_tokens(self, num_tokens: int) -> int:
        """The KV slots ``num_tokens`` positions take from a page boundary on: whole pages."""
        return -(-num_tokens // self.page_size) * self.page_size

    def pages_needed(self, holders: list[MemoryHolder], counts: list[int]) -> int:
        """New KV pages for the next ``counts[i]`` positions of each holder."""
        return self.pools.pages_needed([h.num_computed for h in holders], counts)

    def make_room(self, num_pages: int) -> None:
        """Evicts unused cached prefixes until ``num_pages`` KV pages are free (or nothing more can go)."""
        if self.cache is not None and self.free_pages < num_pages:
            self.cache.evict(num_pages)

    # ---- allocation ---------------------------------------------------------------------------------------------
    def admit(self, holder: MemoryHolder) -> bool:
        """A row and a state slot for ``holder``, which holds no computed position yet; False if none is free."""
        if self.free_rows == 0:
            return False
        (holder.req_row,) = self.pools.req_to_token.allocator.alloc(1)
        (holder.state_slot,) = self.pools.states.alloc(1)
        holder.num_computed = 0
        for listener in self.listeners:
            listener.on_admit(holder)
        return True

    def reserve(self, holder: MemoryHolder, num_tokens: int) -> list[int] | None:
        """A row, a state slot and KV pages for the first ``num_tokens`` positions, which another server computes
        and writes (the PD decode side); their pages, or None, with nothing taken, if they are not free. The
        pages come as one run where the pool has one, so that the transfer writes few blocks."""
        needed = self.pools.pages_needed([0], [num_tokens])
        self.make_room(needed)
        if self.free_rows == 0 or self.free_pages < needed:
            return None
        self.admit(holder)
        self.alloc_kv([holder], [num_tokens])
        holder.num_computed = num_tokens
        return self.pages_of(holder, num_tokens)

    def alloc_kv(self, holders: list[MemoryHolder], counts: list[int]) -> list[int]:
        """KV slots for the next ``counts[i]`` positions of each holder (after its computed ones), in its pages
        (new pages recorded in its row); unused cached prefixes are evicted first if needed. Raises MemoryError
        when they cannot fit."""
        self.make_room(self.pages_needed(holders, counts))
        return self.pools.alloc_kv(
            [h.req_row for h in holders], [h.num_computed for h in holders], counts
        )

    def free_kv(self, slots: list[int]) -> None:
        """Gives back the KV of positions at the end of holders' rows, past what they keep: the slots of an
        ``alloc_kv`` whose forward did not run to the end, or of rejected draft tokens. Pages that start among
        ``slots`` are freed; a page that also holds a kept position stays."""
        self.pools.free_kv(slots)

    def slots_of(self, holder: MemoryHolder, end: int) -> list[int]:
        """The KV slots of the holder's positions ``0..end``."""
        return self.pools.req_to_token.slots(holder.req_row, 0, end)

    def pages_of(self, holder: MemoryHolder, end: int) -> list[int]:
        """The KV pages of the holder's positions ``0..end`` (the last one partly used unless ``end`` is a page
        boundary)."""
        return self.pools.req_to_token.pages(holder.req_row, 0, end)

    # ---- the prefix cache ---------------------------------------------------------------------------------------
    def reuse_prefix(self, holder: MemoryHolder, max_len: int) -> int:
        """Starts a just-admitted holder from the longest cached prefix of at most ``max_len`` tokens that ends
        at a state snapshot: its whole pages are read in place, a tail's page and the snapshot copied into the
        holder's own. Returns the prefix's length (0 without a hit)."""
        if self.cache is None:
            return 0
        hit = self.cache.match(holder.fill_ids, max_len)
        if hit.length == 0:
            return 0
        end = hit.tail or hit.node
        self.cache.lock(end)  # nothing of the hit is evicted while the tail's page is found
        try:
            self._read_prefix(holder, hit)
        except MemoryError:  # no page for the tail: no hit
            self.cache.unlock(end)
            return 0
        if hit.tail is not None:
            self.cache.lock(hit.node)
            self.cache.unlock(hit.tail)
        self.pools.states.copy_slot(end.snapshot, holder.state_slot)
        holder.num_computed = hit.length
        holder.cache_owned_len = len(hit.pages) * self.page_size
        holder.cache_node = hit.node
        return hit.length

    def _read_prefix(self, holder: MemoryHolder, hit: Hit) -> None:
        row = holder.req_row
        self.pools.map_pages(row, 0, hit.pages)
        if hit.tail is not None:
            start = len(hit.pages) * self.page_size
            count = len(hit.tail.tokens)
            self.make_room(1)
            own = self.pools.alloc_kv([row], [start], [count])
            size = self.page_size
            self.pools.copy_kv([hit.tail.pages[0] * size + i for i in range(count)], own)

    def cache_prefix(self, holder: MemoryHolder) -> None:
        """Hands the holder's computed positions to the prefix cache, with a snapshot of its state: they stay for
        later requests after this one ends. The holder then owns none of its whole pages (duplicates are freed);
        positions after its last whole page stay its own (the cache keeps a copy of them with the snapshot)."""
        n = holder.num_computed
        if self.cache is None or n <= holder.cache_owned_len:
            return
        inserted = self.cache.insert(
            holder.fill_ids[:n], self.pages_of(holder, n), holder.state_slot
        )
        if inserted.duplicates:  # pages the cache already held: read its pages, free ours
            self.pools.map_pages(holder.req_row, 0, inserted.pages)
            self.pools.kv.allocator.free(inserted.duplicates)
        self.cache.lock(inserted.node)
        if holder.cache_node is not None:
            self.cache.unlock(holder.cache_node)
        holder.cache_node = inserted.node
        holder.cache_owned_len = len(inserted.pages) * self.page_size

    def share_prompt(self, parent: MemoryHolder, child: MemoryHolder) -> bool:
        """Admits ``child`` with ``parent``'s computed positions: the cache's pages shared in place, the parent's
        own copied, and a copy of its state. False, with nothing taken, if memory is short."""
        n = parent.num_computed
        shared = parent.cache_owned_len
        if self.free_rows == 0:
            return False
        needed = self.pools.pages_needed([shared], [n - shared])
        self.make_room(needed)
        if self.free_pages < needed:
            return False
        self.admit(child)
        self.pools.map_pages(child.req_row, 0, self.pages_of(parent, shared))
        child.num_computed = shared
        own = self.alloc_kv([child], [n - shared])
        table = self.pools.req_to_token
        self.pools.copy_kv(table.slots(parent.req_row, shared, n), own)
        if parent.cache_node is not None:
            self.cache.lock(parent.cache_node)
            child.cache_node = parent.cache_node
            child.cache_owned_len = shared
        self.pools.states.copy_slot(parent.state_slot, child.state_slot)
        child.num_computed = n
        return True

    def flush_cache(self) -> int:
        """Drops every cached prefix no request uses; returns the KV slots freed."""
        return self.cache.flush() if self.cache is not None else 0

    # ---- release ------------------------------------------------------------------------------------------------
    def release(self, holder: MemoryHolder, cache: bool = True) -> None:
        """Frees all the holder holds; with ``cache``, what it computed goes to the prefix cache first (not after
        a failure: its KV may be half-written)."""
        if cache:
            self.cache_prefix(holder)
        table = self.pools.req_to_token
        own = table.pages(holder.req_row, holder.cache_owned_len, holder.num_computed)
        self.pools.kv.allocator.free(own)
        self.pools.states.allocator.free([holder.state_slot])
        self.pools.req_to_token.allocator.free([holder.req_row])
        for listener in self.listeners:
            listener.on_release(holder)
        if holder.cache_node is not None:
            self.cache.unlock(holder.cache_node)
        holder.req_row = None
        holder.state_slot = None
        holder.cache_node = None
        holder.num_computed = 0
        holder.cache_owned_len = 0

    # ---- accounting ---------------------------------------------------------------------------------------------
    def check(self, holders: list[MemoryHolder]) -> None:
        """Exact accounting: the pools hold precisely what ``holders`` (every holder there is) say they hold."""
        size = self.page_size
        assert all(h.cache_owned_len % size == 0 for h in holders), "the cache owns whole pages"
        owned = sum(-(-h.num_computed // size) - h.cache_owned_len // size for h in holders)
        cached = self.cache.num_pages if self.cache is not None else 0
        assert self.pools.kv.allocator.num_used == owned + cached, "KV pages leaked or lost"
        if self.cache is not None:
            assert self.cache.num_locked_pages <= self.cache.num_pages, (
                "prefix-cache locks out of step"
            )
            self.cache.check()
        assert self.pools.req_to_token.allocator.num_used == len(holders), "request rows leaked"
        assert self.pools.states.allocator.num_used == len(holders), "state slots leaked"
