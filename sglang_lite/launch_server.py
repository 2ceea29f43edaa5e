"""``python -m sglang_lite.launch_server``: the HTTP server with its DP scheduler processes.

Every ServerArgs field is a flag (``--dp-size 2 --port 30000 --api-key KEY ...``); see ``--help``. The server binds
its port first (a port in use is one line at once), loads the model in its rank processes, and prints
``ready: http://HOST:PORT (...)`` when it serves. Several nodes run the same command with their own
``--node-rank``: node 0 serves HTTP, every other node only runs its ranks of the world (``run_node``) until they
exit or it is told to stop.

Bad arguments exit with status 2 and one line; a start-up that fails exits with 1 and one line (the traceback too
under ``--log-level debug``).
"""

from __future__ import annotations

import atexit
import logging
import signal
import socket
import sys
import threading

from sglang_lite.server_args import ServerArgs
from sglang_lite.utils.cli import OneLineParser, StartupError, listen

logger = logging.getLogger("sglang_lite.launch_server")


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    parser = OneLineParser(
        prog="launch_server",
        description="sglang_lite HTTP server (SGLang-native and OpenAI-compatible API)",
    )
    ServerArgs.add_cli_args(parser)
    namespace = parser.parse_args(argv)
    try:
        args = ServerArgs.from_cli_args(namespace)
    except ValueError as error:  # a bad value or combination: argparse's one line and status 2
        parser.error(str(error))
    configure_logging(args.log_level)
    return args


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # uvicorn warns of every malformed request, such as sglang-router's plain-TCP liveness probes
    logging.getLogger("uvicorn.error").addFilter(_InvalidRequestsAtDebug())


class _InvalidRequestsAtDebug(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != "Invalid HTTP request received.":
            return True
        return logging.getLogger().isEnabledFor(logging.DEBUG)


def ready_line(args: ServerArgs) -> str:
    model = args.served_model_name or args.model_path or "the built-in tiny model"
    host = f"[{args.host}]" if ":" in args.host else args.host
    return f"ready: http://{host}:{args.port} ({model}, dp {args.dp_size}, tp {args.tp_size})"


def run_server(args: ServerArgs, sock: socket.socket) -> None:
    from sglang_lite.runtime.spawn import spawn_ranks
    from sglang_lite.utils.process import stop_processes

    # The ranks start before this process imports the serving stack: their interpreters import torch and load the
    # model meanwhile (a server on the built-in model answered /health after 4.0 s instead of 6.5 on 2 Zen 3 cores).
    spawned = spawn_ranks(args)
    manager = None  # once made, its client owns the ranks (a respawned one too)

    def stop_ranks() -> None:
        """Even if uvicorn exits abnormally, or the front end fails before it runs."""
        client = manager.client if manager is not None else None
        stop_processes(client.all_processes if client else spawned.processes, grace_s=0.0)

    atexit.register(stop_ranks)
    import uvicorn

    from sglang_lite.server.connections import allow_open_files
    from sglang_lite.server.http_protocol import edge_protocol
    from sglang_lite.server.http_server import create_app
    from sglang_lite.server.tokenizer_manager import TokenizerManager

    manager = TokenizerManager(args, spawned)
    app = create_app(args, manager)
    app.state.keep_startup_error = True

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if app.state.startup_error is not None:
                self.should_exit = True
            elif self.started:
                print(ready_line(args), file=sys.stderr, flush=True)

    uvicorn_level = "info" if args.log_level == "debug" else "warning"
    allow_open_files(args.max_connections)
    config = uvicorn.Config(
        app,
        log_level=uvicorn_level,
        timeout_keep_alive=args.http_keep_alive_timeout_s,
        http=edge_protocol(args),
    )
    config.access_log = args.log_level == "debug"
    server = Server(config)
    server.run(sockets=[sock])
    error = app.state.startup_error
    if error is not None:
        raise StartupError(f"the server did not start: {error}") from error
    if not server.started:
        raise StartupError("the server did not start (see the lines above)")


def run_node(args: ServerArgs) -> int:
    """A node other than 0: starts this node's ranks of the world, waits on them, and stops them on SIGTERM or
    SIGINT. Returns the exit code: 0 when stopped or when every rank ended cleanly."""
    from sglang_lite.runtime.spawn import spawn_world, world_init_address
    from sglang_lite.utils.process import stop_processes

    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    processes = spawn_world(args, 0, world_init_address(args, 0), {}, None)
    try:
        while not stopping.wait(0.2) and all(p.poll() is None for p in processes):
            pass
    finally:
        stop_processes(processes, grace_s=0.0 if stopping.is_set() else 3.0)
    codes = [p.returncode for p in processes]
    return 0 if stopping.is_set() or not any(codes) else 1


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        sys.exit(_start(args))
    except Exception as error:  # noqa: BLE001 - one line for the user, the traceback at debug
        _exit_with(args, error)


def _start(args: ServerArgs) -> int:
    layout = f"dp_size={args.dp_size} tp_size={args.tp_size} nnodes={args.nnodes}"
    if args.node_rank > 0:
        first = args.node_rank * args.ranks_per_node
        print(
            f"sglang_lite node {args.node_rank}: world ranks [{first}, {first + args.ranks_per_node}) {layout}",
            file=sys.stderr,
            flush=True,
        )
        return run_node(args)
    sock = listen(args.host, args.port)
    print(
        f"sglang_lite server: loading, then serving http://{args.host}:{args.port} ({layout})",
        file=sys.stderr,
        flush=True,
    )
    run_server(args, sock)
    return 0


def _exit_with(args: ServerArgs, error: BaseException) -> None:
    if args.log_level == "debug":
        logger.exception("start-up failed")
    message = str(error) if isinstance(error, StartupError) else f"{type(error).__name__}: {error}"
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


if __name__ == "__main__":
    main()
