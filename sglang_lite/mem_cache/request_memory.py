"""The one owner of what requests hold in the pools: a row of ``req_to_token``, a linear-attention state slot,
the KV slots of their computed positions (recorded in the row), and what they hand to the prefix cache.

Every allocation and every release of request memory happens here, for the scheduler, both PD sides, parallel
samples and ``generate.py``. A holder (a scheduler ``Req``, or a ``Holding`` for callers without one) says what
it holds in five fields; this class keeps them and the pools in step:

- ``admit`` gives a holder a row and a state slot; ``reserve`` also the KV of a prompt that another server
  computes (the PD decode side).
- ``alloc_kv`` takes KV slots for the next tokens of a batch before it is built; a failed forward gives them
  back with ``free_kv``.
- ``reuse_prefix`` / ``cache_prefix``: the prefix cache's KV read in place and a snapshot of the state after it;
  ``share_prompt`` gives a parallel sample its parent's prompt.
- ``release`` frees it all, caching what was computed first when asked to.

Listeners (the sampler's per-row state, the admission order) hear of each admission and release, so no path can
skip one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.mem_cache.radix_cache import RadixCache


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

    # ---- what is free -----------------------------------------------------------------------------------------
    @property
    def free_rows(self) -> int:
        """Requests that can still be admitted (each needs a row and a state slot)."""
        return min(self.pools.req_to_token.allocator.num_free, self.pools.states.allocator.num_free)

    @property
    def kv_free(self) -> int:
        """KV slots free now, counting the unused cached prefixes that eviction would free."""
        return self.pools.kv.allocator.num_free + self.evictable_tokens

    @property
    def evictable_tokens(self) -> int:
        return self.cache.evictable_tokens if self.cache is not None else 0

    @property
    def cached_tokens(self) -> int:
        return self.cache.num_tokens if self.cache is not None else 0

    def make_room(self, num_tokens: int) -> None:
        """Evicts unused cached prefixes until ``num_tokens`` KV slots are free (or nothing more can go)."""
        if self.cache is not None and self.pools.kv.allocator.num_free < num_tokens:
            self.cache.evict(num_tokens)

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
        """A row, a state slot and KV slots for the first ``num_tokens`` positions, which another server computes
        and writes (the PD decode side); None, with nothing taken, if they are not free."""
        if self.free_rows == 0 or self.pools.kv.allocator.num_free < num_tokens:
            return None
        self.admit(holder)
        slots = self.alloc_kv([holder], [num_tokens])
        holder.num_computed = num_tokens
        return slots

    def alloc_kv(self, holders: list[MemoryHolder], counts: list[int]) -> list[int]:
        """KV slots for the next ``counts[i]`` positions of each holder (after its computed ones), recorded in
        its row; unused cached prefixes are evicted first if needed. Raises MemoryError when they cannot fit."""
        self.make_room(sum(counts))
        return self.pools.alloc_kv(
            [h.req_row for h in holders], [h.num_computed for h in holders], counts
        )

    def free_kv(self, slots: list[int]) -> None:
        """Gives back the slots of an ``alloc_kv`` whose forward did not run to the end."""
        self.pools.kv.allocator.free(slots)

    def slots_of(self, holder: MemoryHolder, end: int) -> list[int]:
        """The KV slots of the holder's positions ``0..end``."""
        return self.pools.req_to_token.req_to_token[holder.req_row, :end].tolist()

    # ---- the prefix cache ---------------------------------------------------------------------------------------
    def reuse_prefix(self, holder: MemoryHolder, max_len: int) -> int:
        """Starts a just-admitted holder from the longest cached prefix of at most ``max_len`` tokens that ends
        at a state snapshot: its KV slots are read in place, the snapshot copied into the holder's own slot.
        Returns the prefix's length (0 without a hit)."""
        if self.cache is None:
            return 0
        hit, node, kv = self.cache.match(holder.fill_ids, max_len)
        if hit == 0:
            return 0
        self.cache.lock(node)
        self._write_row(holder.req_row, 0, kv)
        self.pools.states.copy_slot(node.snapshot, holder.state_slot)
        holder.num_computed = hit
        holder.cache_owned_len = hit
        holder.cache_node = node
        return hit

    def cache_prefix(self, holder: MemoryHolder) -> None:
        """Hands the holder's computed positions to the prefix cache, with a snapshot of its state: they stay for
        later requests after this one ends. The holder then owns none of them (duplicates are freed)."""
        n = holder.num_computed
        if self.cache is None or n <= holder.cache_owned_len:
            return
        inserted = self.cache.insert(
            holder.fill_ids[:n], self.slots_of(holder, n), holder.state_slot
        )
        if (
            inserted is None
        ):  # no snapshot slot to be had: nothing cached, the holder keeps what it owns
            return
        node, slots, duplicates = inserted
        if duplicates:  # positions the cache already held: read its slots, free ours
            self._write_row(holder.req_row, 0, slots)
            self.pools.kv.allocator.free(duplicates)
        self.cache.lock(node)
        if holder.cache_node is not None:
            self.cache.unlock(holder.cache_node)
        holder.cache_node = node
        holder.cache_owned_len = n

    def share_prompt(self, parent: MemoryHolder, child: MemoryHolder) -> bool:
        """Admits ``child`` with ``parent``'s computed positions: the cache's shared in place, the parent's own
        copied, and a copy of its state. False, with nothing taken, if memory is short."""
        n = parent.num_computed
        shared = parent.cache_owned_len
        if self.free_rows == 0:
            return False
        self.make_room(n - shared)
        if self.pools.kv.allocator.num_free < n - shared:
            return False
        self.admit(child)
        table = self.pools.req_to_token.req_to_token
        table[child.req_row, :shared] = table[parent.req_row, :shared]
        child.num_computed = shared
        own = self.alloc_kv([child], [n - shared])
        self.pools.copy_kv(table[parent.req_row, shared:n].tolist(), own)
        if shared:
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
        own = self.pools.req_to_token.req_to_token[
            holder.req_row, holder.cache_owned_len : holder.num_computed
        ]
        if own.numel():
            self.pools.kv.allocator.free(own.tolist())
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
        owned = sum(h.num_computed - h.cache_owned_len for h in holders)
        assert self.pools.kv.allocator.num_used == owned + self.cached_tokens, (
            "KV slots leaked or lost"
        )
        if self.cache is not None:
            assert self.cache.num_locked_tokens <= self.cache.num_tokens, (
                "prefix-cache locks out of step"
            )
        assert self.pools.req_to_token.allocator.num_used == len(holders), "request rows leaked"
        assert self.pools.states.allocator.num_used == len(holders), "state slots leaked"

    def _write_row(self, row: int, start: int, slots: list[int]) -> None:
        table = self.pools.req_to_token.req_to_token
        table[row, start : start + len(slots)] = torch.tensor(
            slots, dtype=table.dtype, device=table.device
        )
