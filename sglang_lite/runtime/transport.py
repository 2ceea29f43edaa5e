"""Where messages travel: ZMQ over IPC sockets, unique to one front end.

Each scheduler process binds a PULL socket for its commands; the front end binds one PULL socket that every rank
pushes its replies to. Sends never block. A rank's command queue is bounded (``COMMAND_QUEUE_LIMIT`` messages on the
front end's side): a rank drains its inbox every step, so a full queue means a rank that stopped stepping, and
``send`` reports it (False) instead of queueing without end. Replies are unbounded: the front end always reads them.
The sockets' addresses (files in the temp dir) come from ``spawn.ipc_addresses``.
"""

from __future__ import annotations

import zmq

from sglang_lite.runtime.messages import Message, encode

COMMAND_QUEUE_LIMIT = 4096  # commands queued to one rank (ZMQ's receive side holds up to 1000 more)


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
