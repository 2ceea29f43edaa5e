"""Starting the scheduler processes, without torch: the socket addresses a front end and its ranks share, a rank's
spec, and the ``python -m sglang_lite.runtime.scheduler_process`` children themselves.

``launch_server`` calls ``spawn_ranks`` before it imports the serving stack (torch, the tokenizer): the ranks'
interpreters import and load the model while the front end imports, instead of after it. ``SchedulerClient`` takes
what ``spawn_ranks`` returns, or spawns the ranks itself (the offline Engine, which has imported torch already).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import stat
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Any

from sglang_lite.server_args import ServerArgs
from sglang_lite.utils import cpu_flags

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


@dataclass(frozen=True)
class RankSpec:
    """One process of a world: which world, its rank there, the world's rendezvous, and (world rank 0 on node 0
    only) the command address of each DP rank the world hosts and the front end's reply address."""

    world: int
    world_rank: int = 0
    init_address: str | None = None  # HOST:PORT; None: a world of one
    command_addresses: dict[int, str] = field(default_factory=dict)
    reply_address: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "command_addresses": list(self.command_addresses.items()),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankSpec:
        return cls(
            **{**data, "command_addresses": {int(dp): a for dp, a in data["command_addresses"]}}
        )


def world_init_address(args: ServerArgs, world: int) -> str | None:
    """The rendezvous of a world: ``--dist-init-addr`` (port + world for replica worlds), else a free local port."""
    if args.world_size == 1:
        return None
    if args.dist_init_addr is not None:
        host, _, port = args.dist_init_addr.rpartition(":")
        return f"{host}:{int(port) + world}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def spawn_world(
    args: ServerArgs,
    world: int,
    init_address: str | None,
    command_addresses: dict[int, str],
    reply_address: str | None,
) -> list[subprocess.Popen]:
    """Starts the processes of one world that live on this node (``--node-rank``); world rank 0 gets the sockets."""
    first = args.node_rank * args.ranks_per_node
    specs = [
        RankSpec(
            world,
            rank,
            init_address,
            command_addresses if rank == 0 else {},
            reply_address if rank == 0 else None,
        )
        for rank in range(first, first + args.ranks_per_node)
    ]
    return [spawn_scheduler_process(args, spec) for spec in specs]


def spawn_scheduler_process(args: ServerArgs, spec: RankSpec) -> subprocess.Popen:
    """Starts a rank as ``python -m sglang_lite.runtime.scheduler_process``: a fresh interpreter that, unlike
    multiprocessing's spawn, never re-imports the caller's ``__main__`` (scripts need no main guard)."""
    payload = {"args": dataclasses.asdict(args), "rank": spec.to_json(), "parent_pid": os.getpid()}
    # import what the caller imports, as spawn does; its threads bound to CPUs as --cpu-omp-bind says
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.update(cpu_flags.omp_binding(args, spec.world, spec.world_rank))
    name = [f"--world={spec.world}", f"--rank={spec.world_rank}"]
    process = subprocess.Popen(
        [sys.executable, "-m", "sglang_lite.runtime.scheduler_process", *name],
        env=env,
        stdin=subprocess.PIPE,
    )
    try:
        process.stdin.write(json.dumps(payload).encode())
        process.stdin.close()  # the child reads to the end: one spec, then EOF
    except BrokenPipeError:  # the child died at once; the front end sees it exit
        pass
    return process


@dataclass
class SpawnedRanks:
    """The processes of this node's worlds (``worlds[w]``: world w's processes, world rank 0 first) and the sockets'
    addresses they were given: each DP rank's command inbox and the front end's reply socket."""

    command_addresses: list[str]
    reply_address: str
    worlds: list[list[subprocess.Popen]]

    @property
    def processes(self) -> list[subprocess.Popen]:
        return [process for world in self.worlds for process in world]


def spawn_ranks(args: ServerArgs, addresses: tuple[list[str], str] | None = None) -> SpawnedRanks:
    """Starts every world of this node (node 0: the one with the front end) with the given socket addresses
    (``ipc_addresses``'s pair), else fresh ones."""
    command_addresses, reply_address = addresses or ipc_addresses(args.dp_size)
    worlds = []
    for world in range(args.num_worlds):
        commands = {dp: command_addresses[dp] for dp in args.world_dp_ranks(world)}
        init = world_init_address(args, world)
        worlds.append(spawn_world(args, world, init, commands, reply_address))
    return SpawnedRanks(command_addresses, reply_address, worlds)
