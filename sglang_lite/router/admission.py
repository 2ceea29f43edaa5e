"""--max-concurrent-requests with a bounded queue: 429 when the queue is full, 503 when a wait times out."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager


class Shed(Exception):
    def __init__(self, status: int, reason: str, retry_after: int) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.retry_after = retry_after


class Admission:
    def __init__(self, max_concurrent: int, queue_size: int, queue_timeout: float) -> None:
        self.max_concurrent = max_concurrent
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout
        self.waiting = 0
        self._slots = asyncio.Semaphore(max(max_concurrent, 1))

    @property
    def unlimited(self) -> bool:
        return self.max_concurrent < 0

    @asynccontextmanager
    async def slot(self):
        if self.unlimited:
            yield
            return
        await self._acquire()
        try:
            yield
        finally:
            self._slots.release()

    async def _acquire(self) -> None:
        if not self._slots.locked():
            await self._slots.acquire()
            return
        if self.waiting >= self.queue_size:
            raise Shed(429, "too many requests: the router queue is full", retry_after=1)
        self.waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), self.queue_timeout)
        except asyncio.TimeoutError as exc:
            retry_after = max(1, int(self.queue_timeout))
            raise Shed(503, "timed out waiting in the router queue", retry_after) from exc
        finally:
            self.waiting -= 1
