"""Cache-aware routing: an approximate radix tree of the prompts routed to each worker.

Approximate because the router never learns what a server evicted; the tree only remembers what it sent,
bounded by `max_tree_size` characters per worker with least-recently-used leaves evicted first.
"""

from __future__ import annotations

import heapq
import random
from typing import Sequence

from .base import Policy, RequestInfo, WorkerState, healthy_workers


class _Node:
    __slots__ = ("label", "children", "parent", "last_used")

    def __init__(self, label: str, parent: _Node | None, tick: int) -> None:
        self.label = label
        self.children: dict[str, _Node] = {}
        self.parent = parent
        self.last_used = tick


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixTree:
    """A character radix tree; `size` counts the characters stored on its edges."""

    def __init__(self) -> None:
        self.root = _Node("", None, 0)
        self.size = 0
        self._tick = 0  # a logical clock for LRU eviction: policies take no wall time

    def match(self, text: str) -> int:
        """Length of the longest stored prefix of `text` (touches the matched path)."""
        self._tick += 1
        node, pos = self.root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            shared = _common_prefix_len(child.label, text[pos:])
            child.last_used = self._tick
            pos += shared
            if shared < len(child.label):
                break
            node = child
        return pos

    def insert(self, text: str) -> None:
        self._tick += 1
        node, pos = self.root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                node.children[text[pos]] = _Node(text[pos:], node, self._tick)
                self.size += len(text) - pos
                return
            shared = _common_prefix_len(child.label, text[pos:])
            if shared < len(child.label):
                child = self._split(child, shared)
            child.last_used = self._tick
            node, pos = child, pos + shared

    def _split(self, child: _Node, at: int) -> _Node:
        parent = child.parent
        assert parent is not None
        head = _Node(child.label[:at], parent, child.last_used)
        parent.children[head.label[0]] = head
        child.label = child.label[at:]
        child.parent = head
        head.children[child.label[0]] = child
        return head

    def evict(self, max_size: int) -> None:
        """Drop least-recently-used leaves until at most `max_size` characters remain."""
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children]
        heapq.heapify(leaves)
        while self.size > max_size and leaves:
            leaf = heapq.heappop(leaves)[2]
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.label[0]]
            self.size -= len(leaf.label)
            if parent is not self.root and not parent.children:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


class CacheAwarePolicy(Policy):
    name = "cache_aware"
    needs_text = True

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_size: int = 2**26,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.trees: dict[str, RadixTree] = {}

    def select(
        self, workers: Sequence[WorkerState], request: RequestInfo, rng: random.Random
    ) -> WorkerState | None:
        healthy = healthy_workers(workers)
        if not healthy:
            return None
        self._sync_trees(workers)
        chosen = (
            self._least_loaded(healthy)
            if self.is_imbalanced(healthy)
            else self._by_cache(healthy, request.text)
        )
        self._record(chosen.url, request.text)
        return chosen

    def is_imbalanced(self, healthy: Sequence[WorkerState]) -> bool:
        loads = [w.in_flight for w in healthy]
        low, high = min(loads), max(loads)
        return high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold

    def _least_loaded(self, healthy: list[WorkerState]) -> WorkerState:
        return min(healthy, key=lambda w: w.in_flight)

    def _by_cache(self, healthy: list[WorkerState], text: str) -> WorkerState:
        matches = [(self.trees[w.url].match(text), w) for w in healthy]
        best_len, best = max(matches, key=lambda m: m[0])  # max() keeps the first of equal matches
        if text and best_len / len(text) > self.cache_threshold:
            return best
        return min(healthy, key=lambda w: self.trees[w.url].size)

    def _record(self, url: str, text: str) -> None:
        tree = self.trees[url]
        tree.insert(text)
        if tree.size > self.max_tree_size:
            tree.evict(self.max_tree_size)

    def _sync_trees(self, workers: Sequence[WorkerState]) -> None:
        # A removed worker's tree goes with it; a new worker starts empty (and so attracts new prefixes).
        urls = {w.url for w in workers}
        for url in urls - self.trees.keys():
            self.trees[url] = RadixTree()
        for url in self.trees.keys() - urls:
            del self.trees[url]
