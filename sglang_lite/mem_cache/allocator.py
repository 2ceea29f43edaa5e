"""Free lists of the pools: ``SlotAllocator`` for request rows and state slots, ``PageAllocator`` for KV pages.

A PD transfer writes a request's KV as one block per run of pages that are consecutive on both sides, so KV pages
are handed out in runs: the first run of free pages long enough, else the fewest longest runs.
"""

from __future__ import annotations

import numpy as np


class SlotAllocator:
    """Free list over slots first..first + size - 1 (by default 1..size: slot 0 is reserved)."""

    def __init__(self, size: int, name: str, first: int = 1) -> None:
        self.size = size
        self.name = name
        self._free = list(range(first + size - 1, first - 1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.size - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n slots, or None when fewer than n are free (nothing is taken then)."""
        if n > len(self._free):
            return None
        taken = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        return taken[::-1]

    def free(self, slots: list[int]) -> None:
        # kept so that the next alloc hands them out ascending
        self._free.extend(sorted(slots, reverse=True))
        assert len(self._free) <= self.size, f"{self.name}: freed more slots than exist"


class PageAllocator:
    """Pages 1..size (page 0 is reserved), handed out in runs of consecutive pages where the free ones allow."""

    def __init__(self, size: int, name: str) -> None:
        self.size = size
        self.name = name
        self._free = np.ones(size + 1, dtype=bool)
        self._free[0] = False
        self._num_free = size

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.size - self._num_free

    def alloc(self, n: int, after: int | None = None) -> list[int] | None:
        """n pages, or None when fewer are free (nothing is taken then): the n pages right after page ``after``
        when they are free (a request growing keeps one run), else the first free run of n, else the longest
        runs there are."""
        if n > self._num_free:
            return None
        if n == 0:
            return []
        pages = self._following(after, n)
        if pages is None:
            pages = self._runs_for(n)
        self._free[pages] = False
        self._num_free -= n
        return pages.tolist()

    def free(self, pages: list[int]) -> None:
        if not pages:
            return
        index = np.asarray(pages, dtype=np.int64)
        assert not self._free[index].any(), f"{self.name}: a page freed twice"
        self._free[index] = True
        self._num_free += len(pages)
        assert self._num_free <= self.size, f"{self.name}: freed more pages than exist"

    def _following(self, after: int | None, n: int) -> np.ndarray | None:
        if (
            after is None
            or after + n > self.size
            or not self._free[after + 1 : after + 1 + n].all()
        ):
            return None
        return np.arange(after + 1, after + 1 + n)

    def _runs_for(self, n: int) -> np.ndarray:
        if n == 1:
            return np.array([int(self._free.argmax())])
        edges = np.diff(self._free.view(np.int8), prepend=0, append=0)
        starts = np.flatnonzero(edges == 1)
        lengths = np.flatnonzero(edges == -1) - starts
        fits = np.flatnonzero(lengths >= n)
        if fits.size:
            return np.arange(starts[fits[0]], starts[fits[0]] + n)
        longest = np.argsort(-lengths, kind="stable")
        pieces, left = [], n
        for i in longest:
            take = min(int(lengths[i]), left)
            pieces.append(np.arange(starts[i], starts[i] + take))
            left -= take
            if left == 0:
                break
        return np.sort(np.concatenate(pieces))
