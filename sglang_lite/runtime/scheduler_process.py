"""Scheduler processes: a *world* of ``tp_size`` processes runs one model (torch.distributed); each DP rank is one
scheduler, driven by typed messages.

Without DP attention every DP rank is a world of its own; with it one world holds every DP rank (its attention
groups). World rank 0 is the only process that talks to the front end: it takes the commands of every DP rank its
world hosts and broadcasts them over the world, every rank applies those of its own DP rank to its own scheduler
(the ranks of a DP rank run identical schedulers: same commands, same order, same seeds, same decisions), and only
a DP rank's leader replies; leaders on other ranks reach rank 0 through a gather. The loop reads: take commands ->
step -> send replies. Under DP attention the world steps together (any rank with work steps every rank; a rank with
no batch runs an idle forward). A world of one is the plain case: no collectives, one process, one DP rank.

A process exits when told to (``Stop``, to the whole world), when its parent is gone, or when it is broken
(``scheduler.faults``: a failed collective too, so a dead or hung peer ends the world, never hangs it); a failure
of one request or one step fails only those requests. The spec (every server argument, the API key included)
travels on stdin, never on the command line that ``ps`` shows.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import logging
import os
import select
import signal
import sys
from typing import TYPE_CHECKING

import zmq

from sglang_lite.distributed import (
    ParallelState,
    any_ranks,
    broadcast_object,
    gather_objects,
    init_distributed,
)
from sglang_lite.protocol.outputs import ReqOutput
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
    FlushCache,
    FlushReply,
    LoadsQuery,
    LoadsReply,
    Message,
    Ready,
    Reserved,
    StepOutputs,
    Stop,
    TransferTarget,
    decode,
)
from sglang_lite.runtime.spawn import RankSpec
from sglang_lite.runtime.transport import pull_socket, push_socket, send
from sglang_lite.scheduler.faults import breaks_the_device, describe
from sglang_lite.server_args import ServerArgs, set_global_server_args
from sglang_lite.utils import cpu_flags
from sglang_lite.utils.process import keep_freed_heap_memory

if TYPE_CHECKING:  # the front end imports this module without torch
    from sglang_lite.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)
# --log-level -> Mooncake's MC_LOG_LEVEL
MOONCAKE_LOG_LEVELS = {"debug": "INFO", "info": "WARNING", "warning": "WARNING", "error": "ERROR"}
IDLE_POLL_MS = 500  # how often an idle world of one checks that its parent still lives
# an idle multi-rank world: followers wait in a collective at most this long per round
WORLD_POLL_MS = 50
PD_POLL_MS = 2  # a PD rank waiting only on transfers checks its metadata rows this often
_CLIENT = "aborted by the client"  # the message of a client's abort


def main() -> None:
    """Reads the spec from stdin (see ``spawn.spawn_scheduler_process``); the arguments only name the process in
    ``ps``."""
    payload = json.loads(sys.stdin.buffer.read())
    args = ServerArgs(**payload["args"])
    run_scheduler_process(args, RankSpec.from_json(payload["rank"]), payload["parent_pid"])


def run_scheduler_process(args: ServerArgs, spec: RankSpec, parent_pid: int) -> None:
    """Body of a rank process."""
    _die_with_parent()
    keep_freed_heap_memory()
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"[world {spec.world} rank {spec.world_rank}] %(asctime)s %(levelname)s %(message)s",
    )
    # the transfer engine's own log (PD): warnings and above unless debugging
    os.environ.setdefault("MC_LOG_LEVEL", MOONCAKE_LOG_LEVELS[args.log_level])
    context = zmq.Context()
    front_end = FrontEnd(context, spec) if spec.reply_address is not None else None
    try:
        WorldLoop(args, spec, front_end, parent_pid).run()
    except BaseException as error:  # tell the front end why (world rank 0), then die
        if args.log_level == "debug":
            logger.exception("world %d rank %d failed", spec.world, spec.world_rank)
        else:
            logger.error(
                "world %d rank %d failed: %s: %s",
                spec.world,
                spec.world_rank,
                type(error).__name__,
                error,
            )
        if front_end is not None:
            front_end.fatal(f"{type(error).__name__}: {error}")
        sys.exit(1)
    finally:
        context.destroy(linger=1000)


class FrontEnd:
    """World rank 0's sockets: the command inbox of each DP rank its world hosts, and the front end's reply inbox."""

    def __init__(self, context: zmq.Context, spec: RankSpec) -> None:
        self.replies = push_socket(context, spec.reply_address, linger_ms=1000)
        self.inboxes = {
            dp: pull_socket(context, address) for dp, address in spec.command_addresses.items()
        }
        # one poller for the life of the loop: Socket.poll builds one per call
        self.poller = zmq.Poller()
        for inbox in self.inboxes.values():
            self.poller.register(inbox, zmq.POLLIN)

    def take(self, timeout_ms: int) -> list[tuple[int, Message]]:
        """Every command waiting now (after up to ``timeout_ms`` for the first), with its DP rank, in order."""
        if not self.poller.poll(timeout_ms):
            return []
        commands = []
        for dp, inbox in self.inboxes.items():
            while True:
                try:
                    frame = inbox.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    commands.append((dp, decode(frame)))
                except ValueError:  # a front end's bug; the requests already here keep running
                    logger.exception("DP rank %d: dropped an unreadable command", dp)
        return commands

    def send(self, message: Message) -> None:
        send(self.replies, message)

    def fatal(self, message: str) -> None:
        for dp in self.inboxes:
            self.send(Fatal(dp, message))


class InboxArrivals:
    """Commands arriving at a rank's one inbox, as a run of decode steps watches for them (``scheduler/decode.py``'s
    ``Arrivals``): ZMQ's file descriptor of the socket turns readable when a message arrives after the socket's
    events were last read (edge-triggered: reading ``ZMQ_EVENTS`` re-arms it)."""

    def __init__(self, inbox: zmq.Socket) -> None:
        self.inbox = inbox
        self.fd: int = inbox.getsockopt(zmq.FD)

    def waiting(self) -> bool:
        return bool(self.inbox.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def arrived(self) -> bool:
        return bool(select.select([self.fd], [], [], 0)[0])


class WorldLoop:
    """One process of a world: its DP rank's scheduler, stepped in step with the rest of the world."""

    def __init__(
        self, args: ServerArgs, spec: RankSpec, front_end: FrontEnd | None, parent_pid: int
    ) -> None:
        args = _rank_args(args, spec)
        self.args = args
        self.front_end = front_end
        self.parent_pid = parent_pid
        self.state = _join_world(args, spec)
        self.dp_rank = spec.world * args.dp_ranks_per_world + self.state.attn_dp_rank
        self.leader = self.state.attn_tp_rank == 0  # the one rank of its DP rank that replies
        # DP attention: one forward per step on every rank
        self.lockstep = self.state.config.attn_dp_size > 1
        self.idle_poll_ms = IDLE_POLL_MS if self.state.world_size == 1 else WORLD_POLL_MS
        self.scheduler = _create_scheduler(args, self.dp_rank)
        if front_end is not None and self.state.world_size == 1 and len(front_end.inboxes) == 1:
            # a rank alone: a command arriving ends its run of decode steps
            self.scheduler.watch_arrivals(InboxArrivals(*front_end.inboxes.values()))
        self.outbox: list[Message] = []
        self.busy = False  # any rank of the world had work last round
        self.forwarding = False  # of which forwards to run
        self.stopped = False

    def run(self) -> None:
        plan = self.scheduler.runner.stream_plan()
        gc.freeze()  # the model and pools live as long as the rank: out of the collector's sweeps (2% of a decode)
        self.reply(Ready(self.dp_rank, os.getpid(), self.scheduler.config, plan))
        # ready once every rank of the world has built its model
        self.send_replies(gather=self.state.world_size > 1)
        while not self.stopped:
            self.take_commands()
            if self.stopped:
                return
            outputs = self.step()
            if outputs:
                self.reply(StepOutputs(self.dp_rank, outputs))
            for notice in self.scheduler.disagg.take_notices():
                self.reply(Reserved(self.dp_rank, notice["rid"], notice["room"], notice["target"]))
            self.send_replies(gather=self.args.dp_ranks_per_world > 1)

    def reply(self, message: Message) -> None:
        if self.leader:
            self.outbox.append(message)

    def send_replies(self, gather: bool) -> None:
        """The leaders' replies go out at world rank 0 (``gather``: through a gather over the world, needed when
        leaders live on other ranks)."""
        outbox, self.outbox = self.outbox, []
        if gather:
            boxes = gather_objects(outbox, self.state.cpu_world, dst=0)
            outbox = [message for box in boxes or [] for message in box]
        if self.front_end is not None:
            for message in outbox:
                self.front_end.send(message)

    def step(self) -> list[ReqOutput]:
        scheduler = self.scheduler
        if not self.lockstep:
            # every rank of the world holds the same requests: the same answer everywhere
            self.busy = scheduler.has_work
            outputs = scheduler.step() if self.busy else []
            self.forwarding = scheduler.has_runnable_work
            return outputs
        # DP attention: the world forwards together when any rank has a batch (the others run idle forwards); while
        # none has one (waiting on PD transfers or grammars) it only polls
        scheduler.poll()
        batch = scheduler.schedule()
        flags = (scheduler.has_work, batch is not None)
        self.busy, self.forwarding = any_ranks(flags, self.state.cpu_world)
        scheduler.execute(batch, must_forward=self.forwarding)
        return scheduler.take_outputs()

    def wait_ms(self) -> int:
        """How long rank 0 may wait for commands: not at all with work to run, a little while only PD transfers
        or grammars are awaited (their metadata rows are polled), the idle poll otherwise."""
        if not self.busy:
            return self.idle_poll_ms
        return 0 if self.forwarding else PD_POLL_MS

    # ---- commands ----------------------------------------------------------------------------------------------
    def take_commands(self) -> None:
        """World rank 0 takes the commands (waiting a little only when the world is idle) and broadcasts them with
        the stop flag; every rank applies those of its own DP rank."""
        taken: tuple[list[tuple[int, Message]], bool] = ([], False)
        if self.front_end is not None:
            commands = self.front_end.take(self.wait_ms())
            stop = os.getppid() != self.parent_pid or any(isinstance(c, Stop) for _, c in commands)
            taken = ([(dp, c) for dp, c in commands if not isinstance(c, Stop)], stop)
        commands, self.stopped = broadcast_object(taken, self.state.cpu_world, src=0)
        for dp, command in commands:
            if dp == self.dp_rank:
                self.apply(command)

    def apply(self, command: Message) -> None:
        """Runs one command; one that raises is logged and dropped (an AddRequest is acked as failed), unless the
        error broke the device."""
        try:
            self._apply(command)
        except Exception as error:
            if breaks_the_device(error):
                raise
            logger.exception("DP rank %d: %s failed", self.dp_rank, type(command).__name__)

    def _apply(self, command: Message) -> None:
        if isinstance(command, AddRequest):
            self.reply(self.add(command))
        elif isinstance(command, AbortRequest):
            failed = command.error is not None  # else a client's abort
            message, status = (command.error, command.status_code) if failed else (_CLIENT, None)
            self.scheduler.abort(command.rid, message, status, command.settled)
        elif isinstance(command, TransferTarget):
            self.scheduler.disagg.on_target(command.room, command.target)
        elif isinstance(command, LoadsQuery):
            loads = self.scheduler.get_loads().to_dict(command.sections)
            self.reply(LoadsReply(self.dp_rank, command.query_id, loads))
        elif isinstance(command, CheckQuery):
            self.reply(CheckReply(self.dp_rank, command.query_id, self.invariant_error()))
        elif isinstance(command, FlushCache):
            self.reply(FlushReply(self.dp_rank, command.query_id, self.scheduler.flush_cache()))
        else:
            raise TypeError(f"a scheduler process takes commands, not {type(command).__name__}")

    def add(self, request: AddRequest) -> Ack:
        """Queues the request unless the waiting queue is full."""
        if (
            len(self.scheduler.queues.waiting) + len(self.scheduler.grammar_queue)
            >= self.args.max_queued_requests
        ):
            message = f"rank {self.dp_rank}: the waiting queue is full ({self.args.max_queued_requests} requests)"
            return Ack(self.dp_rank, request.rid, UNAVAILABLE, message)
        try:
            self.scheduler.add_request(
                request.rid,
                request.input_ids,
                request.sampling_params,
                request.bootstrap_room,
                request.logprob,
                request.stream,
                request.local,
                request.images,
            )
        except (ValueError, TypeError, AssertionError) as error:
            return Ack(self.dp_rank, request.rid, REFUSED, str(error))
        # not the input's fault as far as validation knows: fail it, keep the rank
        except Exception as error:
            if breaks_the_device(error):
                raise
            logger.exception("DP rank %d: adding %s failed", self.dp_rank, request.rid)
            return Ack(self.dp_rank, request.rid, FAILED, describe(error))
        return Ack(self.dp_rank, request.rid, QUEUED)

    def invariant_error(self) -> str | None:
        """Why the pools do not hold exactly what the requests hold, or None when they do."""
        try:
            self.scheduler.check_invariants()
        except AssertionError as error:
            return str(error) or "scheduler invariants do not hold"
        return None


def _rank_args(args: ServerArgs, spec: RankSpec) -> ServerArgs:
    """This rank's copy of the arguments: its DP rank's share of the server's limits (``per_dp_rank``) and, on
    GPUs, a device of its own for each process of this node (the replica worlds of one node one after another)."""
    args = args.per_dp_rank()
    if args.device != "cuda" or args.world_size == 1:
        return args
    import torch

    local = (
        spec.world * args.ranks_per_node + spec.world_rank - args.node_rank * args.ranks_per_node
    )
    return dataclasses.replace(args, device=f"cuda:{local % max(1, torch.cuda.device_count())}")


def _join_world(args: ServerArgs, spec: RankSpec) -> ParallelState:
    """Joins the world (a world of one joins nothing); model code reads the state when the model is built."""
    return init_distributed(
        args.parallel_config,
        spec.world_rank,
        spec.init_address or "",
        args.device,
        args.dist_timeout,
    )


def _create_scheduler(args: ServerArgs, dp_rank: int) -> Scheduler:
    import torch

    from sglang_lite.runtime.factory import create_scheduler

    if args.device == "cpu":
        torch.set_num_threads(args.cpu_threads)
        logger.info("%d CPU threads, %s", args.cpu_threads, cpu_flags.describe_binding())
    set_global_server_args(args)  # the one setter: model code reads it lazily, at construction
    return create_scheduler(args, dp_rank=dp_rank)


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies, even by SIGKILL; elsewhere the loop checks."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # Ctrl-C reaches the whole group; the parent stops us


if __name__ == "__main__":
    main()
