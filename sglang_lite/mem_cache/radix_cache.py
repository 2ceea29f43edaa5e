"""Prefix cache for the hybrid model: a radix tree of token ids whose nodes own KV pages, with Gated DeltaNet state
snapshots where a prefix ends (SGLang's ``MambaRadixCache`` idea).

A full-attention layer's KV of a prefix can be reused by any request that starts with it, but a GDN layer's state
after the prefix cannot be rebuilt from keys and values: it is saved as a snapshot (a conv + recurrent state slot
of its own) at the node where the prefix ends. A request therefore reuses the longest cached prefix that ends at a
snapshot, copies the snapshot into its own state slot (never shared mutably) and prefills only the rest.

The tree works in pages (``page_size`` tokens, upstream's paged radix tree): an edge holds whole pages of tokens
and a request reads the tree's pages in place. A prefix that ends inside a page (a prompt's end, a chunk's) keeps
its last tokens as a *tail*: a leaf below the last whole page with a copy of their KV in a page of its own and the
snapshot; a request whose match ends in a tail copies that page into one of its own, since it writes the rest of
the page. So a hit can end at any token, as with pages of one token, for one copied page.

- ``match``: longest prefix (at most ``max_len`` tokens) ending at a snapshot; its pages and tail.
- ``insert``: hands a request's whole pages of a prefix to the tree (pages the tree already holds keep the tree's:
  the request's duplicates come back to be freed) and saves a snapshot of its state at the end.
- ``lock`` / ``unlock``: a node in use by a request (and its ancestors) keeps its KV.
- ``evict``: frees unlocked leaves (their pages and snapshots) until enough pages are free: first leaves without a
  snapshot (no match can end there), then the least recently used.
- Snapshots are a cached resource of their own (upstream's ``evict_mamba``): when a new one finds no free slot,
  the least recently used snapshot of any node, inner ones included, is freed and the node keeps its KV, which
  still serves a longer match that ends at a deeper snapshot (a tail, which serves nothing else, goes with it). A
  request copies a snapshot into its own state slot when it is admitted, so freeing one never touches a running
  request.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from sglang_lite.mem_cache.pools import ModelPools, SlotAllocator


@dataclass(eq=False)
class Node:
    tokens: list[int] = field(
        default_factory=list
    )  # the edge from the parent: whole pages, or a tail
    pages: list[int] = field(
        default_factory=list
    )  # one KV page per page of the edge (a tail: its copy)
    parent: Node | None = None
    children: dict[tuple[int, ...], Node] = field(
        default_factory=dict
    )  # by their first page's tokens
    tails: dict[tuple[int, ...], Node] = field(default_factory=dict)  # by their tokens
    snapshot: int | None = None  # state slot holding the GDN state after this node's last token
    lock: int = 0
    last_access: float = 0.0
    is_tail: bool = False

    @property
    def is_leaf(self) -> bool:
        return not self.children and not self.tails


class Hit(NamedTuple):
    length: int  # tokens matched (0: no hit)
    node: Node  # the node ending the match's whole pages: what the request locks
    pages: list[int]  # the pages of the whole pages, read in place
    tail: Node | None  # the tail the match ends in, whose page the request copies


class Inserted(NamedTuple):
    node: Node  # the node ending the prefix's whole pages
    pages: list[int]  # the tree's pages of those whole pages (the request reads these)
    duplicates: list[int]  # the request's pages the tree already had, to be freed


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
        self.page_size = pools.page_size
        self.root = Node()
        self.num_pages = 0  # KV pages the tree owns
        self.num_locked_pages = 0  # of which in use by requests (not evictable)
        self.snapshots_evicted = 0  # snapshots freed to make room for newer ones, since start
        self._order = itertools.count()
        # the nodes holding a snapshot, by its slot: evict_snapshot looks among them, not the whole tree
        self._holders: dict[int, Node] = {}

    @property
    def num_tokens(self) -> int:
        """KV slots the tree owns."""
        return self.num_pages * self.page_size

    @property
    def evictable_tokens(self) -> int:
        return (self.num_pages - self.num_locked_pages) * self.page_size

    # ---- lookups -----------------------------------------------------------------------------------------------
    def match(self, tokens: list[int], max_len: int) -> Hit:
        """The longest cached prefix of ``tokens`` of at most ``max_len`` tokens that ends at a snapshot; a hit of
        length 0 at the root when none."""
        size = self.page_size
        node, depth = self.root, 0
        pages: list[int] = []
        now = self.clock()
        best = self._tail_hit(node, tokens, 0, max_len, Hit(0, node, [], None), now)
        while depth + size <= len(tokens):
            child = node.children.get(tuple(tokens[depth : depth + size]))
            if child is None or _common_pages(child.tokens, tokens[depth:], size) < len(
                child.tokens
            ):
                break  # a match ending inside an edge ends at no snapshot
            depth += len(child.tokens)
            pages += child.pages
            node = child
            node.last_access = now
            if node.snapshot is not None and depth <= max_len:
                best = Hit(depth, node, [], None)
            best = self._tail_hit(node, tokens, depth, max_len, best, now)
        whole = best.length - (len(best.tail.tokens) if best.tail else 0)
        return best._replace(pages=pages[: whole // size])

    def _tail_hit(
        self, node: Node, tokens: list[int], depth: int, max_len: int, best: Hit, now: float
    ) -> Hit:
        for tail in node.tails.values():
            end = depth + len(tail.tokens)
            if end > best.length and end <= max_len and tokens[depth:end] == tail.tokens:
                tail.last_access = now
                best = Hit(end, node, [], tail)
        return best

    def lock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock == 0:
                self.num_locked_pages += len(node.pages)
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            node.lock -= 1
            if node.lock == 0:
                self.num_locked_pages -= len(node.pages)
            node = node.parent

    # ---- insertion ---------------------------------------------------------------------------------------------
    def insert(self, tokens: list[int], pages: list[int], state_slot: int) -> Inserted:
        """Caches ``tokens`` (KV in the request's ``pages``, one per page of positions) with a snapshot of
        ``state_slot`` at the end, when a snapshot slot (and for a tail, a page) can be had."""
        size = self.page_size
        aligned = len(tokens) // size * size
        node, depth = self.root, 0
        path: list[int] = []
        duplicates: list[int] = []
        now = self.clock()
        while depth < aligned:
            child = node.children.get(tuple(tokens[depth : depth + size]))
            if child is None:
                child = Node(tokens[depth:aligned], pages[depth // size : aligned // size], node)
                node.children[tuple(tokens[depth : depth + size])] = child
                self.num_pages += len(child.pages)
            n = _common_pages(child.tokens, tokens[depth:aligned], size)
            if n < len(child.tokens):
                child = self._split(child, n)
            ours = pages[depth // size : (depth + n) // size]
            duplicates += [p for p, q in zip(ours, child.pages) if p != q]
            path += child.pages
            depth += n
            node = child
            node.last_access = now
        tail_page = pages[aligned // size] if aligned < len(tokens) else 0
        self._snapshot_at(node, tokens[aligned:], tail_page, state_slot, now)
        return Inserted(node, path, duplicates)

    def _snapshot_at(
        self, node: Node, tail: list[int], tail_page: int, state_slot: int, now: float
    ) -> None:
        """A snapshot of ``state_slot`` after ``tail`` below ``node`` (a tail node holding a copy of its KV, which
        the request holds at the start of ``tail_page``)."""
        node.last_access = now
        target = node.tails.get(tuple(tail)) if tail else node
        if target is not None and target.snapshot is not None:
            target.last_access = now
            return  # the same prefix was cached before: its snapshot is as good
        snapshot = self._snapshot_slot()
        if snapshot is None:
            return
        if target is None:
            target = self._new_tail(node, tail, tail_page)
            if target is None:
                self.snapshots.free([snapshot])
                return
        target.last_access = now
        self.pools.states.copy_slot(state_slot, snapshot)
        target.snapshot = snapshot
        self._holders[snapshot] = target

    def _new_tail(self, node: Node, tail: list[int], own: int) -> Node | None:
        """A tail below ``node`` with a copy of the request's KV of ``tail`` (the start of its page ``own``), or
        None when no page can be had."""
        page = self._free_page(node)
        if page is None:
            return None
        size = self.page_size
        self.pools.copy_kv(
            [own * size + i for i in range(len(tail))], [page * size + i for i in range(len(tail))]
        )
        target = Node(list(tail), [page], node, is_tail=True)
        node.tails[tuple(tail)] = target
        self.num_pages += 1
        return target

    def _free_page(self, keep: Node) -> int | None:
        allocator = self.pools.kv.allocator
        if allocator.num_free == 0:
            self.lock(keep)  # eviction must not take the node the tail hangs from
            self.evict(1)
            self.unlock(keep)
        pages = allocator.alloc(1)
        return pages[0] if pages else None

    def _split(self, child: Node, n: int) -> Node:
        """Cuts ``child``'s edge after ``n`` tokens (whole pages); returns the new upper node (no snapshot: it ends
        mid-prefix)."""
        size = self.page_size
        upper = Node(
            child.tokens[:n],
            child.pages[: n // size],
            child.parent,
            lock=child.lock,
            last_access=child.last_access,
        )
        child.parent.children[tuple(child.tokens[:size])] = upper
        child.tokens = child.tokens[n:]
        child.pages = child.pages[n // size :]
        child.parent = upper
        upper.children[tuple(child.tokens[:size])] = child
        return upper

    def _snapshot_slot(self) -> int | None:
        slots = self.snapshots.alloc(1)
        if slots is None and self.evict_snapshot():
            slots = self.snapshots.alloc(1)
        return slots[0] if slots else None

    # ---- eviction ----------------------------------------------------------------------------------------------
    def evict(self, num_pages: int) -> None:
        """Frees unlocked leaves until ``num_pages`` KV pages are free, or nothing more can go: leaves without a
        snapshot first, then the least recently used."""
        kv = self.pools.kv.allocator
        leaves = [self._eviction_key(n) for n in self._nodes() if n.is_leaf and n.lock == 0]
        heapq.heapify(leaves)
        while leaves and kv.num_free < num_pages:
            *_, node = heapq.heappop(leaves)
            parent = self._remove(node)
            if parent is not self.root and parent.is_leaf and parent.lock == 0:
                heapq.heappush(leaves, self._eviction_key(parent))

    def _eviction_key(self, node: Node) -> tuple[bool, float, int, Node]:
        return (node.snapshot is not None, node.last_access, next(self._order), node)

    def evict_snapshot(self) -> bool:
        """Frees the least recently used snapshot of any node, which keeps its KV (a tail goes with its snapshot:
        nothing else can be read there); False if there is none."""
        if not self._holders:
            return False
        oldest = min(n.last_access for n in self._holders.values())
        tied = [n for n in self._holders.values() if n.last_access == oldest]
        # one clock reading for several (a path matched at once): the first of them in the tree's walk
        if len(tied) > 1:
            tied = [n for n in self._nodes() if n.snapshot is not None and n.last_access == oldest]
        node = tied[0]
        self.snapshots_evicted += 1
        if node.is_tail:
            self._remove(node)
            return True
        self.snapshots.free([node.snapshot])
        del self._holders[node.snapshot]
        node.snapshot = None
        return True

    def flush(self) -> int:
        """Evicts every unlocked node; returns the KV slots freed."""
        before = self.num_pages
        self.evict(self.pools.kv.allocator.size + 1)
        return (before - self.num_pages) * self.page_size

    def _remove(self, node: Node) -> Node:
        self.pools.kv.allocator.free(node.pages)
        self.num_pages -= len(node.pages)
        if node.snapshot is not None:
            self.snapshots.free([node.snapshot])
            del self._holders[node.snapshot]
        parent = node.parent
        if node.is_tail:
            del parent.tails[tuple(node.tokens)]
        else:
            del parent.children[tuple(node.tokens[: self.page_size])]
        return parent

    def _nodes(self) -> list[Node]:
        """Every node but the root, tails included."""
        out = []
        stack = [*self.root.children.values(), *self.root.tails.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack += [*node.children.values(), *node.tails.values()]
        return out

    def check(self) -> None:
        """The index of snapshot holders is the tree's, and holds every snapshot slot in use."""
        held = {n.snapshot: n for n in self._nodes() if n.snapshot is not None}
        assert held == self._holders, (
            "the prefix cache's index of snapshots is out of step with its tree"
        )
        assert self.snapshots.num_used == len(held), "prefix-cache snapshot slots leaked"

    @property
    def num_snapshots(self) -> int:
        return self.snapshots.num_used


def _common_pages(a: list[int], b: list[int], size: int) -> int:
    """The leading tokens ``a`` and ``b`` share, in whole pages."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n // size * size
