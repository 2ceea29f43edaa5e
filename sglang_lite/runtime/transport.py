"""Where messages travel: ZMQ over IPC sockets, unique to one front end.

Each scheduler process binds a PULL socket for its commands; the front end binds one PULL socket that every rank
pushes its replies to. Sends never block. A rank's command queue is bounded (``COMMAND_QUEUE_LIMIT`` messages on the
front end's side): a rank drains its inbox every step, so a full queue means a rank that stopped stepping, and
``send`` reports it (False) instead of queueing without end. Replies are unbounded: the front end always reads them.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
import uuid

import zmq

from sglang_lite.runtime.messages import Message, encode

COMMAND_QUEUE_LIMIT = 4096  # commands queued to one rank (ZMQ's receive side holds up to 1000 more)


# The socket files ipc_addresses names: sglang_lite_<front end pid>_<8 hex>_<rank N | replies>.
_IPC_FILE = re.compile(r"sglang_lite_(\d+)_[0-9a-f]{8}_(?:rank\d+|replies)")


def ipc_addresses(dp_size: int) -> tuple[list[str], str]:
    """(command address of each rank, reply address of the front end), unique to this front end. First removes
    the files of front ends that no longer run (remove_stale_ipc_files)."""
    remove_stale_ipc_files()
    base = os.path.join(tempfile.gettempdir(), f"sglang_lite_{os.getpid()}_{uuid.uuid4().hex[:8]}")
    return [f"ipc://{base}_rank{r}" for r in range(dp_size)], f"ipc://{base}_replies"


def remove_stale_ipc_files(directory: str | None = None) -> list[str]:
    """Removes the socket files that front ends killed without their shutdown (SIGKILL, the OOM killer) left in
    ``directory`` (the temp dir): those whose front end's pid no longer runs. A pid that runs, ours or another
    user's, keeps its files. Returns the names removed."""
    directory = directory or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        match = _IPC_FILE.fullmatch(name)
        if match is None or _pid_runs(int(match.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)
                removed.append(name)
        except OSError:  # gone meanwhile, or not ours to remove
            pass
    return removed


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def remove_ipc_files(addresses: list[str]) -> None:
    for address in addresses:
        path = address.removeprefix("ipc://")
        if os.path.exists(path):
            os.unlink(path)


def push_socket(
    context: zmq.Context, address: str, linger_ms: int = 0, limit: int = 0
) -> zmq.Socket:
    """A socket that pushes to ``address``; ``limit`` bounds its queued messages (0: unbounded)."""
    socket = context.socket(zmq.PUSH)
    socket.setsockopt(zmq.SNDHWM, limit)
    socket.setsockopt(zmq.LINGER, linger_ms)
    socket.connect(address)
    return socket


def pull_socket(context: zmq.Context, address: str) -> zmq.Socket:
    socket = context.socket(zmq.PULL)
    socket.bind(address)
    return socket


def send(socket: zmq.Socket, message: Message) -> bool:
    """Queues the message; False when the socket's queue is full (nothing was queued)."""
    try:
        socket.send(encode(message), zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True
