"""The cap on open HTTP connections (``--max-connections``): connections waiting for a request, the longest waiting
first, and those being served. Beyond the cap the one that has waited longest is closed, so a flood of idle sockets
costs valid clients nothing: a new connection is refused only when every open one is being served."""

from __future__ import annotations

import logging
import resource
from collections import OrderedDict
from typing import Protocol

logger = logging.getLogger(__name__)
# descriptors the server needs besides its connections: rank transports, pipes, the grammar checkers, logs
SPARE_FILES = 1024


class Connection(Protocol):
    def close_idle(self) -> None:
        """Closes the connection to make room (it holds no request that is being served)."""


class ConnectionTable:
    """Every open connection, each either waiting for a request (ordered by when it began to wait) or being
    served."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.waiting: OrderedDict[Connection, None] = OrderedDict()
        self.serving: set[Connection] = set()

    def __len__(self) -> int:
        return len(self.waiting) + len(self.serving)

    def opened(self, connection: Connection) -> bool:
        """Counts a new connection, closing the longest-waiting others while over the cap; False when there is no
        room even so (the caller refuses the new one)."""
        self.waiting[connection] = None
        while len(self) > self.limit:
            oldest = next(iter(self.waiting))
            if oldest is connection:
                self.waiting.pop(connection)
                return False
            self.waiting.pop(oldest)
            oldest.close_idle()
        return True

    def wait(self, connection: Connection) -> None:
        """The connection's request is done: it waits for the next one, the newest waiter."""
        self.serving.discard(connection)
        self.waiting[connection] = None

    def serve(self, connection: Connection) -> None:
        """The connection's request has arrived: it is never closed to make room."""
        self.waiting.pop(connection, None)
        self.serving.add(connection)

    def linger(self, connection: Connection) -> None:
        """The connection was answered and is closing: the first to close when room is needed."""
        self.serving.discard(connection)
        self.waiting[connection] = None
        self.waiting.move_to_end(connection, last=False)

    def closed(self, connection: Connection) -> None:
        self.waiting.pop(connection, None)
        self.serving.discard(connection)


def allow_open_files(connections: int) -> None:
    """Raises the soft limit on open files to ``connections`` plus the server's own where the hard limit allows:
    past it accept() fails and the event loop stops accepting for a second, valid clients included."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + SPARE_FILES
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if raised > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    if raised < wanted:
        logger.warning(
            "open files are limited to %d (ulimit -n): fewer than --max-connections %d needs (%d); "
            "lower --max-connections or raise the limit",
            raised,
            connections,
            wanted,
        )
