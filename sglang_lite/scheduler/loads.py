"""The rank's throughput meter behind ``gen_throughput``."""

from __future__ import annotations

import collections


class ThroughputMeter:
    """Tokens per second over the last ``window_s`` seconds (or since ``start``, if that is more recent).

    Time is passed in, so the figure is testable and the meter holds no clock of its own.
    """

    def __init__(self, start: float, window_s: float = 10.0) -> None:
        self.start = start
        self.window_s = window_s
        self._events: collections.deque[tuple[float, int]] = collections.deque()

    def record(self, now: float, tokens: int) -> None:
        self._events.append((now, tokens))
        self._trim(now)

    def rate(self, now: float) -> float:
        self._trim(now)
        span = min(self.window_s, now - self.start)
        return sum(n for _, n in self._events) / span if span > 0 else 0.0

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
