"""Where messages travel: ZMQ over IPC sockets, unique to one front end.

Each scheduler process binds a PULL socket for its commands; the front end binds one PULL socket that every rank
pushes its replies to. Sends never block. A rank's command queue is bounded (``COMMAND_QUEUE_LIMIT`` messages on the
front end's side): a rank drains its inbox every step, so a full queue means a rank that stopped stepping, and
``send`` reports it (False) instead of queueing without end. Replies are unbounded: the front end always reads them.
"""

from __future__ import annotations

import os
import tempfile
import uuid

import zmq

from sglang_lite.runtime.messages import Message, encode

COMMAND_QUEUE_LIMIT = 4096  # commands queued to one rank (ZMQ's receive side holds up to 1000 more)


def ipc_addresses(dp_size: int) -> tuple[list[str], str]:
    """(command address of each rank, reply address of the front end), unique to this front end."""
    base = os.path.join(tempfile.gettempdir(), f"sglang_lite_{os.getpid()}_{uuid.uuid4().hex[:8]}")
    return [f"ipc://{base}_rank{r}" for r in range(dp_size)], f"ipc://{base}_replies"


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
