"""Where messages travel: ZMQ over IPC sockets, unique to one front end.

Each scheduler process binds a PULL socket for its commands; the front end binds one PULL socket that every rank
pushes its replies to. Push sockets never drop or block (no high-water mark): a rank's inbox is bounded by
admission instead (``--max-queued-requests``).
"""
from __future__ import annotations

import os
import tempfile
import uuid

import zmq

from sglang_lite.runtime.messages import Message, encode


def ipc_addresses(dp_size: int) -> tuple[list[str], str]:
    """(command address of each rank, reply address of the front end), unique to this front end."""
    base = os.path.join(tempfile.gettempdir(), f"sglang_lite_{os.getpid()}_{uuid.uuid4().hex[:8]}")
    return [f"ipc://{base}_rank{r}" for r in range(dp_size)], f"ipc://{base}_replies"


def remove_ipc_files(addresses: list[str]) -> None:
    for address in addresses:
        path = address.removeprefix("ipc://")
        if os.path.exists(path):
            os.unlink(path)


def push_socket(context: zmq.Context, address: str, linger_ms: int = 0) -> zmq.Socket:
    socket = context.socket(zmq.PUSH)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.LINGER, linger_ms)
    socket.connect(address)
    return socket


def pull_socket(context: zmq.Context, address: str) -> zmq.Socket:
    socket = context.socket(zmq.PULL)
    socket.bind(address)
    return socket


def send(socket: zmq.Socket, message: Message) -> None:
    socket.send(encode(message), zmq.NOBLOCK)
