"""The transport between the HTTP process and the scheduler processes: ZMQ over IPC sockets, msgpack frames.

Each rank binds a PULL socket for commands; the HTTP process binds one PULL socket that every rank PUSHes its
replies to. A message is a msgpack list whose first item names its kind.

HTTP process -> rank:  ["add", rid, input_ids, sampling_params]  ["abort", rid]  ["stop"]
                       ["loads", query_id(, sections)]  ["check", query_id]
rank -> HTTP process:  ["ready", rank, info]  ["ack", rank, rid, status, message]  (status 200: queued)
                       ["out", rank, [[rid, new_ids, new_text, finished, meta_info], ...]]
                       ["loads", rank, query_id, loads]  ["checked", rank, query_id, error or None]
                       ["fatal", rank, message]
The offline Engine speaks the same protocol to its one scheduler process.
"""
from __future__ import annotations

import os
import tempfile
import uuid
from typing import Any

import msgpack


def ipc_addresses(dp_size: int) -> tuple[list[str], str]:
    """(command address of each rank, reply address of the HTTP process), unique to this server."""
    base = os.path.join(tempfile.gettempdir(), f"sglang_lite_{os.getpid()}_{uuid.uuid4().hex[:8]}")
    return [f"ipc://{base}_rank{r}" for r in range(dp_size)], f"ipc://{base}_replies"


def remove_ipc_files(addresses: list[str]) -> None:
    for address in addresses:
        path = address.removeprefix("ipc://")
        if os.path.exists(path):
            os.unlink(path)


def pack(message: list[Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes) -> list[Any]:
    return msgpack.unpackb(frame, raw=False)
