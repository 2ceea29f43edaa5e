"""Prefix cache for the hybrid model: a radix tree of token ids whose nodes own KV slots, with Gated DeltaNet state
snapshots where a prefix ends (SGLang's ``MambaRadixCache`` idea).

A full-attention layer's KV of a prefix can be reused by any request that starts with it, but a GDN layer's state
after the prefix cannot be rebuilt from keys and values: it is saved as a snapshot (a conv + recurrent state slot
of its own) at the node where the prefix ends. A request therefore reuses the longest cached prefix that ends at a
snapshot, copies the snapshot into its own state slot (never shared mutably) and prefills only the rest.

- ``match``: longest prefix (at most ``max_len`` tokens) ending at a node with a snapshot; its KV slots.
- ``insert``: hands a request's KV slots of a prefix to the tree (positions the tree already holds keep the tree's
  slots: the request's duplicates come back to be freed) and saves a snapshot of its state at the end.
- ``lock`` / ``unlock``: a node in use by a request (and its ancestors) keeps its KV.
- ``evict``: frees unlocked leaves (their KV slots and snapshots) until enough KV slots are free: first leaves
  without a snapshot (no match can end there), then the least recently used.
- Snapshots are a cached resource of their own (upstream's ``evict_mamba``): when a new one finds no free slot,
  the least recently used snapshot of any node, inner ones included, is freed and the node keeps its KV, which
  still serves a longer match that ends at a deeper snapshot. A request copies a snapshot into its own state slot
  when it is admitted, so freeing one never touches a running request.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sglang_lite.mem_cache.pools import ModelPools, SlotAllocator


@dataclass(eq=False)
class Node:
    tokens: list[int] = field(default_factory=list)  # the edge from the parent
    kv: list[int] = field(default_factory=list)  # one KV slot per token of the edge
    parent: Node | None = None
    children: dict[int, Node] = field(default_factory=dict)
    snapshot: int | None = None  # state slot holding the GDN state after this node's last token
    lock: int = 0
    last_access: float = 0.0

    @property
    def is_leaf(self) -> bool:
        return not self.children


class RadixCache:
    def __init__(
        self,
        pools: ModelPools,
        snapshots: SlotAllocator,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.pools = pools
        self.snapshots = snapshots
        self.clock = clock
        self.root = Node()
        self.num_tokens = 0  # KV slots the tree owns
        self.num_locked_tokens = 0  # of which in use by requests (not evictable)
        self.snapshots_evicted = 0  # snapshots freed to make room for newer ones, since start
        self._order = itertools.count()

    # ---- lookups -----------------------------------------------------------------------------------------------
    def match(self, tokens: list[int], max_len: int) -> tuple[int, Node, list[int]]:
        """(length, node, KV slots) of the longest cached prefix of ``tokens`` of at most ``max_len`` tokens that
        ends at a snapshot; (0, root, []) when none."""
        node = self.root
        depth = 0
        slots = []
        best = (0, self.root, 0)  # length, node, number of slots
        now = self.clock()
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            n = _common(child.tokens, tokens[depth:])
            if n < len(child.tokens):  # ends inside the edge: no snapshot there
                break
            depth += n
            slots.extend(child.kv)
            node = child
            node.last_access = now
            if node.snapshot is not None and depth <= max_len:
                best = (depth, node, len(slots))
        length, node, count = best
        return length, node, slots[:count]

    def lock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock == 0:
                self.num_locked_tokens += len(node.tokens)
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            node.lock -= 1
            if node.lock == 0:
                self.num_locked_tokens -= len(node.tokens)
            node = node.parent

    @property
    def evictable_tokens(self) -> int:
        return self.num_tokens - self.num_locked_tokens

    # ---- insertion ---------------------------------------------------------------------------------------------
    def insert(
        self, tokens: list[int], kv: list[int], state_slot: int
    ) -> tuple[Node, list[int], list[int]] | None:
        """Caches ``tokens`` (KV in ``kv``, one slot each) with a snapshot of ``state_slot`` at the end.

        Returns (the end node, the KV slots the tree now has for ``tokens`` (the request should read these), the
        request's slots the tree already had, to be freed), or None when no snapshot slot could be had (nothing
        was cached)."""
        snapshot = self._snapshot_slot()
        if snapshot is None:
            return None
        node = self.root
        depth = 0
        now = self.clock()
        duplicates = []
        path = []
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                child = Node(list(tokens[depth:]), list(kv[depth:]), node)
                node.children[tokens[depth]] = child
                self.num_tokens += len(child.tokens)
                path.extend(child.kv)
                depth = len(tokens)
                node = child
                break
            n = _common(child.tokens, tokens[depth:])
            if n < len(child.tokens):
                child = self._split(child, n)
            duplicates.extend(s for s, t in zip(kv[depth : depth + n], child.kv) if s != t)
            path.extend(child.kv)
            depth += n
            node = child
            node.last_access = now
        node.last_access = now
        if node.snapshot is None:
            self.pools.states.copy_slot(state_slot, snapshot)
            node.snapshot = snapshot
        else:  # the same prefix was cached meanwhile: its snapshot is as good
            self.snapshots.free([snapshot])
        return node, path, duplicates

    def _split(self, child: Node, n: int) -> Node:
        """Cuts ``child``'s edge after ``n`` tokens; returns the new upper node (no snapshot: it ends mid-prefix)."""
        upper = Node(
            child.tokens[:n],
            child.kv[:n],
            child.parent,
            lock=child.lock,
            last_access=child.last_access,
        )
        child.parent.children[child.tokens[0]] = upper
        child.tokens = child.tokens[n:]
        child.kv = child.kv[n:]
        child.parent = upper
        upper.children[child.tokens[0]] = child
        return upper

    def _snapshot_slot(self) -> int | None:
        slots = self.snapshots.alloc(1)
        if slots is None and self.evict_snapshot():
            slots = self.snapshots.alloc(1)
        return slots[0] if slots else None

    # ---- eviction ----------------------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> None:
        """Frees unlocked leaves until ``num_tokens`` KV slots are free, or nothing more can go: leaves without a
        snapshot first, then the least recently used."""
        kv = self.pools.kv.allocator
        leaves = [self._eviction_key(n) for n in self._leaves() if n.lock == 0]
        heapq.heapify(leaves)
        while leaves and kv.num_free < num_tokens:
            *_, node = heapq.heappop(leaves)
            parent = self._remove(node)
            if parent is not self.root and parent.is_leaf and parent.lock == 0:
                heapq.heappush(leaves, self._eviction_key(parent))

    def _eviction_key(self, node: Node) -> tuple[bool, float, int, Node]:
        return (node.snapshot is not None, node.last_access, next(self._order), node)

    def evict_snapshot(self) -> bool:
        """Frees the least recently used snapshot of any node, which keeps its KV; False if there is none."""
        nodes = [n for n in self._nodes() if n.snapshot is not None]
        if not nodes:
            return False
        node = min(nodes, key=lambda n: n.last_access)
        self.snapshots.free([node.snapshot])
        node.snapshot = None
        self.snapshots_evicted += 1
        return True

    def flush(self) -> int:
        """Evicts every unlocked node; returns the KV slots freed."""
        before = self.num_tokens
        self.evict(self.pools.kv.allocator.size + 1)
        return before - self.num_tokens

    def _remove(self, node: Node) -> Node:
        kv = self.pools.kv.allocator
        kv.free(node.kv)
        self.num_tokens -= len(node.kv)
        if node.snapshot is not None:
            self.snapshots.free([node.snapshot])
        parent = node.parent
        del parent.children[node.tokens[0]]
        return parent

    def _nodes(self) -> list[Node]:
        """Every node but the root."""
        out = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _leaves(self) -> list[Node]:
        return [n for n in self._nodes() if n.is_leaf]

    @property
    def num_snapshots(self) -> int:
        return self.snapshots.num_used


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
