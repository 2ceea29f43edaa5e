"""One DP rank: a process that owns a model replica, its pools and a Scheduler, driven by typed messages.

The loop reads: take commands -> step the scheduler -> send outputs. It blocks on commands only when the scheduler
is idle, so loads asked for between steps are live. The process exits when told to, when its parent is gone, or
when it is broken (``scheduler.faults``); a failure of one request or one step fails only those requests.
Front ends start ranks with ``spawn_scheduler_process`` (through ``SchedulerClient``). The rank's spec (every server
argument, the API key included) travels on its stdin, never on the command line that ``ps`` shows.
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

from sglang_lite.runtime.messages import (
    FAILED,
    QUEUED,
    REFUSED,
    UNAVAILABLE,
    AbortRequest,
    Ack,
    AddRequest,
    CheckQuery,
    CheckReply,
    Fatal,
    LoadsQuery,
    LoadsReply,
    Message,
    Ready,
    StepOutputs,
    Stop,
    decode,
)
from sglang_lite.runtime.transport import pull_socket, push_socket, send
from sglang_lite.scheduler.faults import breaks_the_device, describe
from sglang_lite.server_args import ServerArgs, set_global_server_args
from sglang_lite.utils.process import keep_freed_heap_memory

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 500  # how often an idle rank checks that its parent still lives


def spawn_scheduler_process(args: ServerArgs, dp_rank: int, command_address: str,
                            reply_address: str) -> subprocess.Popen:
    """Starts a rank as ``python -m sglang_lite.runtime.scheduler_process``: a fresh interpreter that, unlike
    multiprocessing's spawn, never re-imports the caller's ``__main__`` (scripts need no main guard)."""
    spec = {"args": dataclasses.asdict(args), "dp_rank": dp_rank, "command_address": command_address,
            "reply_address": reply_address, "parent_pid": os.getpid()}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))  # import what the caller imports, as spawn does
    process = subprocess.Popen([sys.executable, "-m", "sglang_lite.runtime.scheduler_process", f"--dp-rank={dp_rank}"],
                               env=env, stdin=subprocess.PIPE)
    try:
        process.stdin.write(json.dumps(spec).encode())
        process.stdin.close()  # the child reads to the end: one spec, then EOF
    except BrokenPipeError:  # the child died at once; the front end sees it exit
        pass
    return process


def main() -> None:
    """Reads the spec from stdin (see ``spawn_scheduler_process``); the ``--dp-rank`` argument only names the
    process in ``ps``."""
    spec = json.loads(sys.stdin.buffer.read())
    args = ServerArgs(**spec["args"])
    run_scheduler_process(args, spec["dp_rank"], spec["command_address"], spec["reply_address"], spec["parent_pid"])


def run_scheduler_process(args: ServerArgs, dp_rank: int, command_address: str, reply_address: str,
                          parent_pid: int) -> None:
    """Body of a rank process."""
    _die_with_parent()
    keep_freed_heap_memory()
    logging.basicConfig(level=logging.INFO, format=f"[rank {dp_rank}] %(asctime)s %(levelname)s %(message)s")
    context = zmq.Context()
    replies = push_socket(context, reply_address, linger_ms=1000)
    try:
        RankLoop(args, dp_rank, pull_socket(context, command_address), replies, parent_pid).run()
    except BaseException as error:  # tell the front end why, then die
        logger.exception("rank %d failed", dp_rank)
        send(replies, Fatal(dp_rank, f"{type(error).__name__}: {error}"))
        sys.exit(1)
    finally:
        context.destroy(linger=1000)


class RankLoop:
    def __init__(self, args: ServerArgs, dp_rank: int, commands: zmq.Socket, replies: zmq.Socket,
                 parent_pid: int) -> None:
        self.args, self.dp_rank, self.parent_pid = args, dp_rank, parent_pid
        self.commands, self.replies = commands, replies
        self.poller = zmq.Poller()  # one poller for the life of the loop: Socket.poll builds one per call
        self.poller.register(commands, zmq.POLLIN)
        self.scheduler = _create_scheduler(args, dp_rank)
        self.stopped = False

    def run(self) -> None:
        self.reply(Ready(self.dp_rank, os.getpid(), self.scheduler.config, _alt_stream_plan(self.scheduler.model)))
        while not self.stopped and os.getppid() == self.parent_pid:
            self.take_commands(block=not self.scheduler.has_work)
            outputs = self.scheduler.step() if self.scheduler.has_work else []
            if outputs:
                self.reply(StepOutputs(self.dp_rank, outputs))

    def reply(self, message: Message) -> None:
        send(self.replies, message)

    # ---- commands ----------------------------------------------------------------------------------------------
    def take_commands(self, block: bool) -> None:
        if not self.poller.poll(IDLE_POLL_MS if block else 0):
            return
        while True:
            try:
                frame = self.commands.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                command = decode(frame)
            except ValueError:  # a front end's bug; the requests already here keep running
                logger.exception("rank %d: dropped an unreadable command", self.dp_rank)
                continue
            self.apply(command)

    def apply(self, command: Message) -> None:
        """Runs one command; one that raises is logged and dropped (an AddRequest is acked as failed), unless the
        error broke the device."""
        try:
            self._apply(command)
        except Exception as error:
            if breaks_the_device(error):
                raise
            logger.exception("rank %d: %s failed", self.dp_rank, type(command).__name__)

    def _apply(self, command: Message) -> None:
        if isinstance(command, AddRequest):
            self.reply(self.add(command))
        elif isinstance(command, AbortRequest):
            self.scheduler.abort(command.rid, message="aborted by the client")
        elif isinstance(command, LoadsQuery):
            loads = self.scheduler.get_loads().to_dict(command.sections)
            self.reply(LoadsReply(self.dp_rank, command.query_id, loads))
        elif isinstance(command, CheckQuery):
            self.reply(CheckReply(self.dp_rank, command.query_id, self.invariant_error()))
        elif isinstance(command, Stop):
            self.stopped = True
        else:
            raise TypeError(f"a scheduler process takes commands, not {type(command).__name__}")

    def add(self, request: AddRequest) -> Ack:
        """Queues the request unless the waiting queue is full."""
        if len(self.scheduler.waiting) >= self.args.max_queued_requests:
            message = f"rank {self.dp_rank}: the waiting queue is full ({self.args.max_queued_requests} requests)"
            return Ack(self.dp_rank, request.rid, UNAVAILABLE, message)
        try:
            self.scheduler.add_request(request.rid, request.input_ids, request.sampling_params)
        except (ValueError, TypeError, AssertionError) as error:
            return Ack(self.dp_rank, request.rid, REFUSED, str(error))
        except Exception as error:  # not the input's fault as far as validation knows: fail it, keep the rank
            if breaks_the_device(error):
                raise
            logger.exception("rank %d: adding %s failed", self.dp_rank, request.rid)
            return Ack(self.dp_rank, request.rid, FAILED, describe(error))
        return Ack(self.dp_rank, request.rid, QUEUED)

    def invariant_error(self) -> str | None:
        """Why the pools do not hold exactly what the requests hold, or None when they do."""
        try:
            self.scheduler.check_invariants()
        except AssertionError as error:
            return str(error) or "scheduler invariants do not hold"
        return None


def _create_scheduler(args: ServerArgs, dp_rank: int) -> Any:
    import torch

    from sglang_lite.runtime.factory import create_scheduler

    if args.device == "cpu":
        torch.set_num_threads(args.cpu_threads)
    set_global_server_args(args)  # the one setter: model code reads it lazily, at construction
    return create_scheduler(args, dp_rank=dp_rank)


def _alt_stream_plan(runner: Any) -> dict[str, Any] | None:
    """The alternate-stream plan of the model the scheduler runs, when the model has one."""
    streams = getattr(getattr(runner, "model", None), "streams", None)
    return streams.describe() if streams is not None else None


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
