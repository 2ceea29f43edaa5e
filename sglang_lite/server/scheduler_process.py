"""One DP rank: a process that owns a model replica, its pools and a Scheduler, driven over ZMQ.

The loop reads: take commands -> step the scheduler -> send outputs. It blocks on commands only when the scheduler
is idle, so loads asked for between steps are live. The process exits when told to, or when its parent is gone.
Both the HTTP server and the offline Engine start ranks with ``spawn_scheduler_process``.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
from typing import Any

import zmq

from sglang_lite.server.ipc import pack, unpack
from sglang_lite.server_args import ServerArgs
from sglang_lite.utils.process import keep_freed_heap_memory

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 500  # how often an idle rank checks that its parent still lives
LOAD_SECTIONS = ("core", "memory", "queues")


def spawn_scheduler_process(args: ServerArgs, dp_rank: int, command_address: str, reply_address: str) -> subprocess.Popen:
    """Starts a rank as ``python -m sglang_lite.server.scheduler_process``: a fresh interpreter that, unlike
    multiprocessing's spawn, never re-imports the caller's ``__main__`` (scripts need no main guard)."""
    spec = {"args": dataclasses.asdict(args), "dp_rank": dp_rank, "command_address": command_address,
            "reply_address": reply_address, "parent_pid": os.getpid()}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))  # import what the caller imports, as spawn does
    return subprocess.Popen([sys.executable, "-m", "sglang_lite.server.scheduler_process", json.dumps(spec)], env=env)


def main(argv: list[str] | None = None) -> None:
    spec = json.loads((argv or sys.argv[1:])[0])
    args = ServerArgs(**spec["args"])
    run_scheduler_process(args, spec["dp_rank"], spec["command_address"], spec["reply_address"], spec["parent_pid"])


def run_scheduler_process(args: ServerArgs, dp_rank: int, command_address: str, reply_address: str, parent_pid: int) -> None:
    """Body of a rank process."""
    _die_with_parent()
    keep_freed_heap_memory()
    logging.basicConfig(level=logging.INFO, format=f"[rank {dp_rank}] %(asctime)s %(levelname)s %(message)s")
    context = zmq.Context()
    replies = context.socket(zmq.PUSH)
    replies.setsockopt(zmq.LINGER, 1000)
    replies.connect(reply_address)
    try:
        rank = RankLoop(args, dp_rank, context, command_address, replies, parent_pid)
        rank.run()
    except BaseException as error:  # tell the HTTP process why, then die
        logger.exception("rank %d failed", dp_rank)
        replies.send(pack(["fatal", dp_rank, f"{type(error).__name__}: {error}"]))
        sys.exit(1)
    finally:
        context.destroy(linger=1000)


class RankLoop:
    def __init__(self, args: ServerArgs, dp_rank: int, context: zmq.Context, command_address: str,
                 replies: zmq.Socket, parent_pid: int) -> None:
        self.args, self.dp_rank, self.parent_pid = args, dp_rank, parent_pid
        self.replies = replies
        self.scheduler = _create_scheduler(args, dp_rank)
        self.commands = context.socket(zmq.PULL)
        self.commands.bind(command_address)
        self.poller = zmq.Poller()
        self.poller.register(self.commands, zmq.POLLIN)
        self.stopped = False

    def run(self) -> None:
        self.replies.send(pack(["ready", self.dp_rank, self.ready_info()]))
        while not self.stopped and os.getppid() == self.parent_pid:
            self.take_commands(block=not self.scheduler.has_work)
            outputs = self.scheduler.step() if self.scheduler.has_work else []
            if outputs:
                self.send_outputs(outputs)

    def ready_info(self) -> dict[str, Any]:
        config = dataclasses.asdict(self.scheduler.config)
        return {"pid": os.getpid(), "config": config, "alt_stream_plan": _alt_stream_plan(self.scheduler.model)}

    # ---- commands ----------------------------------------------------------------------------------------------
    def take_commands(self, block: bool) -> None:
        if not self.poller.poll(IDLE_POLL_MS if block else 0):
            return
        while True:
            try:
                frame = self.commands.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.apply(unpack(frame))

    def apply(self, command: list[Any]) -> None:
        kind = command[0]
        if kind == "add":
            self.add(*command[1:])
        elif kind == "abort":
            self.scheduler.abort(command[1], message="aborted by the client")
        elif kind == "loads":
            sections = tuple(command[2]) if len(command) > 2 else LOAD_SECTIONS
            loads = self.scheduler.get_loads().to_dict(sections)
            self.replies.send(pack(["loads", self.dp_rank, command[1], loads]))
        elif kind == "check":
            self.replies.send(pack(["checked", self.dp_rank, command[1], self.invariant_error()]))
        elif kind == "stop":
            self.stopped = True

    def invariant_error(self) -> str | None:
        """Why the pools do not hold exactly what the requests hold, or None when they do."""
        try:
            self.scheduler.check_invariants()
        except AssertionError as error:
            return str(error) or "scheduler invariants do not hold"
        return None

    def add(self, rid: str, input_ids: list[int], params: dict[str, Any]) -> None:
        """Queues the request unless the waiting queue is full; always answers with an ack."""
        if len(self.scheduler.waiting) >= self.args.max_queued_requests:
            message = f"rank {self.dp_rank}: the waiting queue is full ({self.args.max_queued_requests} requests)"
            self.replies.send(pack(["ack", self.dp_rank, rid, 503, message]))
            return
        try:
            self.scheduler.add_request(rid, input_ids, params)
        except (ValueError, TypeError, AssertionError) as error:
            self.replies.send(pack(["ack", self.dp_rank, rid, 400, str(error)]))
            return
        self.replies.send(pack(["ack", self.dp_rank, rid, 200, ""]))

    def send_outputs(self, outputs: list[Any]) -> None:
        rows = [[o.rid, o.new_token_ids, o.new_text, o.finished, o.meta_info] for o in outputs]
        self.replies.send(pack(["out", self.dp_rank, rows]))


def _create_scheduler(args: ServerArgs, dp_rank: int) -> Any:
    import torch

    from sglang_lite.engine.launch import create_scheduler
    from sglang_lite.server_args import set_global_server_args

    if args.device == "cpu":
        torch.set_num_threads(args.cpu_threads)
    set_global_server_args(args)
    return create_scheduler(args, dp_rank=dp_rank)


def _alt_stream_plan(model: Any) -> dict[str, Any] | None:
    """The model's alternate-stream plan when the model has one (sglang_lite.streams), else None; the scheduler
    may hold the model itself or a runner around it."""
    streams = getattr(model, "streams", None) or getattr(getattr(model, "model", None), "streams", None)
    describe = getattr(streams, "describe", None)
    return describe() if callable(describe) else None


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies, even by SIGKILL; elsewhere the loop checks."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent stops us


if __name__ == "__main__":
    main()
