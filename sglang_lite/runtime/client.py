"""The client core: a front end's side of its scheduler processes, shared by the offline Engine and the HTTP server.

``SchedulerClient`` starts the scheduler processes (per world, those on this node: see ``scheduler_process``),
waits until every DP rank is ready, sends commands (to world rank 0, which hosts the command inbox of each DP rank of
its world) and receives typed replies; ``dispatch`` hands a reply to the front end's ``ReplyHandler``. The Engine
receives on a thread (``receive``), the HTTP server's tokenizer manager on its event loop (``receive_async``); what
each does with an output (a thread-safe queue, an asyncio queue and metrics) is theirs.

Each rank's command queue is bounded (``transport.COMMAND_QUEUE_LIMIT``): an ``AddRequest`` that finds it full is
answered at once with a 503 ``Ack``, looped back through the reply socket like a rank's own; other commands are
dropped (``send`` returns False). ``respawn`` replaces one rank's process (a supervisor's restart); the reply
socket stays, commands queued to the old process are discarded, and the new process's ``Ready`` is dispatched.
Only a world of one process can be respawned: a bigger world may have ranks on other nodes, so it fails as a whole.
"""

from __future__ import annotations

import itertools
import logging
import subprocess
import threading
import time
from typing import Protocol

import zmq
import zmq.asyncio

from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.protocol.outputs import ReqOutput
from sglang_lite.runtime.messages import (
    UNAVAILABLE,
    Ack,
    AddRequest,
    CheckReply,
    Command,
    Fatal,
    FlushReply,
    LoadsReply,
    QueryReply,
    Ready,
    Reply,
    Reserved,
    StepOutputs,
    Stop,
    decode,
)
from sglang_lite.runtime.spawn import (
    RankSpec,
    SpawnedRanks,
    ipc_addresses,
    remove_ipc_files,
    spawn_ranks,
    spawn_scheduler_process,
)
from sglang_lite.runtime.transport import COMMAND_QUEUE_LIMIT, pull_socket, push_socket, send
from sglang_lite.server_args import ServerArgs
from sglang_lite.utils.process import stop_processes

logger = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 600.0
POLL_MS = 200


class ReplyHandler(Protocol):
    """What a front end does with each kind of reply."""

    def on_outputs(self, rank: int, outputs: list[ReqOutput]) -> None: ...

    def on_ack(self, ack: Ack) -> None: ...

    def on_query_reply(self, reply: QueryReply) -> None: ...

    def on_fatal(self, rank: int, message: str) -> None: ...

    def on_ready(self, ready: Ready) -> None: ...

    def on_reserved(self, reserved: Reserved) -> None: ...


class SchedulerClient:
    """Spawns the ranks on construction (from the calling thread: a rank dies with the thread that started it), or
    takes those ``spawn.spawn_ranks`` started (``spawned``, from the same thread) and owns them from then on."""

    def __init__(self, args: ServerArgs, spawned: SpawnedRanks | None = None) -> None:
        self.args = args
        self.dp_size = args.dp_size
        if spawned is None:
            command_addresses, reply_address = ipc_addresses(args.dp_size)
        else:
            command_addresses, reply_address = spawned.command_addresses, spawned.reply_address
        self._command_addresses, self._reply_address = command_addresses, reply_address
        self._addresses = [*command_addresses, reply_address]
        self._context = zmq.Context()
        self._replies = pull_socket(self._context, reply_address)
        # one for the client's life: Socket.poll builds one per call
        self._reply_poller = zmq.Poller()
        self._reply_poller.register(self._replies, zmq.POLLIN)
        self._async_replies: zmq.asyncio.Socket | None = None
        self._loopback = push_socket(
            self._context, reply_address
        )  # the client's own answers (a full queue)
        self._commands = [self._command_socket(address) for address in command_addresses]
        # zmq sockets are not thread-safe; Engine callers may be on several threads
        self._send_lock = threading.Lock()
        self._query_ids = itertools.count()
        self._closed = False
        # this node's processes, spawned once the sockets exist (unless launch_server spawned them earlier)
        spawned = spawned or spawn_ranks(args, (command_addresses, reply_address))
        self.worlds = spawned.worlds
        self.ready: list[Ready] = []

    @property
    def processes(self) -> list[subprocess.Popen]:
        """The process that talks for each DP rank (its world's rank 0)."""
        return [self.worlds[self.args.world_of(rank)][0] for rank in range(self.dp_size)]

    @property
    def all_processes(self) -> list[subprocess.Popen]:
        return [process for world in self.worlds for process in world]

    @property
    def config(self) -> SchedulerConfig:
        """Every rank's scheduler config, but ``dp_rank`` (rank 0's)."""
        return self.ready[0].config

    # ---- start-up ----------------------------------------------------------------------------------------------
    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> list[Ready]:
        """Blocks until every rank is ready. A rank that fails, exits or is late raises, and everything is stopped."""
        try:
            return self._wait_ready(timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _wait_ready(self, timeout_s: float) -> list[Ready]:
        ready: dict[int, Ready] = {}
        deadline = time.monotonic() + timeout_s
        while len(ready) < self.dp_size:
            reply = self.receive(POLL_MS)
            if isinstance(reply, Fatal):
                raise RuntimeError(
                    f"the scheduler process of DP rank {reply.rank} failed to start: {reply.message}"
                )
            if isinstance(reply, Ready):
                ready[reply.rank] = reply
            exited = self.exited_ranks() if reply is None else {}
            if exited:
                rank, code = next(iter(exited.items()))
                raise RuntimeError(
                    f"the scheduler process of DP rank {rank} exited during start-up (code {code})"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"the scheduler processes were not ready after {timeout_s} s")
        self.ready = [ready[rank] for rank in range(self.dp_size)]
        return self.ready

    def _command_socket(self, address: str) -> zmq.Socket:
        return push_socket(self._context, address, limit=COMMAND_QUEUE_LIMIT)

    # ---- commands and replies ----------------------------------------------------------------------------------
    def send(self, rank: int, command: Command) -> bool:
        """Queues a command to a rank; False when its queue is full (an AddRequest is then acked 503)."""
        with self._send_lock:
            if send(self._commands[rank], command):
                return True
            logger.warning(
                "the command queue of DP rank %d is full: %s not sent", rank, type(command).__name__
            )
            if isinstance(command, AddRequest):
                message = f"DP rank {rank} is not taking commands ({COMMAND_QUEUE_LIMIT} queued)"
                send(self._loopback, Ack(rank, command.rid, UNAVAILABLE, message))
            return False

    def next_query_id(self) -> int:
        return next(self._query_ids)

    def receive(self, timeout_ms: int) -> Reply | None:
        """The next reply, or None after ``timeout_ms``; one thread at a time."""
        if not self._reply_poller.poll(timeout_ms):
            return None
        return decode(self._replies.recv())

    async def receive_async(self) -> Reply:
        """The next reply, awaited on the running event loop (the reply socket shadowed for asyncio)."""
        if self._async_replies is None:
            self._async_replies = zmq.asyncio.Socket.shadow(self._replies.underlying)
        return decode(await self._async_replies.recv())

    def dispatch(self, reply: Reply, handler: ReplyHandler) -> None:
        if isinstance(reply, StepOutputs):
            handler.on_outputs(reply.rank, reply.outputs)
        elif isinstance(reply, Ack):
            handler.on_ack(reply)
        elif isinstance(reply, (LoadsReply, CheckReply, FlushReply)):
            handler.on_query_reply(reply)
        elif isinstance(reply, Fatal):
            handler.on_fatal(reply.rank, reply.message)
        elif isinstance(reply, Reserved):
            handler.on_reserved(reply)
        elif isinstance(reply, Ready):  # a respawned rank
            self.ready[reply.rank] = reply
            handler.on_ready(reply)
        else:
            logger.warning(
                "unexpected %s from DP rank %s", type(reply).__name__, getattr(reply, "rank", "?")
            )

    def exited_ranks(self) -> dict[int, int]:
        """Exit code of each DP rank of which a process has ended (any local process of its world)."""
        exited = {}
        for rank in range(self.dp_size):
            codes = [
                p.returncode for p in self.worlds[self.args.world_of(rank)] if p.poll() is not None
            ]
            if codes:
                exited[rank] = codes[0]
        return exited

    def kill(self, rank: int) -> None:
        """Ends the processes of a rank's world now (SIGKILL) and reaps them; a hung rank answers nothing else."""
        for process in self.worlds[self.args.world_of(rank)]:
            if process.poll() is None:
                process.kill()
            process.wait(10)

    def respawn(self, rank: int) -> None:
        """Replaces a rank's process with a fresh one on the same command address; its ``Ready`` arrives through
        ``dispatch``. Call from the thread that spawned the others (a rank dies with the thread that started it)."""
        if self.args.world_size > 1:
            raise RuntimeError(
                f"DP rank {rank} runs in a world of {self.args.world_size} processes, which cannot be "
                "restarted (its ranks may live on other nodes)"
            )
        self.kill(rank)
        with self._send_lock:
            self._commands[rank].close(
                0
            )  # what the old process never read is dropped, not replayed to the new one
            address = self._command_addresses[rank]
            remove_ipc_files([address])
            world = self.args.world_of(rank)
            spec = RankSpec(
                world, command_addresses={rank: address}, reply_address=self._reply_address
            )
            self.worlds[world] = [spawn_scheduler_process(self.args, spec)]
            self._commands[rank] = self._command_socket(address)

    # ---- shutdown ----------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stops every process (``Stop``, then terminate, then kill) and releases the sockets; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for world, processes in enumerate(self.worlds):
            if processes[0].poll() is None:  # rank 0 stops the whole world
                self.send(self.args.world_dp_ranks(world)[0], Stop())
        stop_processes(self.all_processes)
        for socket in [self._replies, self._loopback, *self._commands]:
            socket.close(0)
        self._context.term()
        remove_ipc_files(self._addresses)
