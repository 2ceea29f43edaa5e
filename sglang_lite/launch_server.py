"""``python -m sglang_lite.launch_server``: the HTTP server with its DP scheduler processes.

Every ServerArgs field is a flag (``--dp-size 2 --port 30000 --api-key KEY ...``); see ``--help``. Several nodes run
the same command with their own ``--node-rank``: node 0 serves HTTP, every other node only runs its ranks of the
world (``run_node``) until they exit or it is told to stop.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import signal
import sys
import threading

from sglang_lite.server_args import ServerArgs


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    parser = argparse.ArgumentParser(
        description="sglang_lite HTTP server (SGLang-native and OpenAI-compatible API)"
    )
    ServerArgs.add_cli_args(parser)
    parser.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error")
    )
    namespace = parser.parse_args(argv)
    logging.basicConfig(
        level=namespace.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return ServerArgs.from_cli_args(namespace)


def run_server(args: ServerArgs) -> None:
    import uvicorn

    from sglang_lite.server.http_server import create_app
    from sglang_lite.utils.process import stop_processes

    app = create_app(args)
    manager = app.state.manager

    def stop_ranks() -> None:  # even if uvicorn exits abnormally
        if manager.client is not None:
            stop_processes(manager.client.all_processes, grace_s=0.0)

    atexit.register(stop_ranks)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=30)


def run_node(args: ServerArgs) -> int:
    """A node other than 0: starts this node's ranks of the world, waits on them, and stops them on SIGTERM or
    SIGINT. Returns the exit code: 0 when stopped or when every rank ended cleanly."""
    from sglang_lite.runtime.scheduler_process import spawn_world, world_init_address
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
    layout = f"dp_size={args.dp_size} tp_size={args.tp_size} nnodes={args.nnodes}"
    if args.node_rank > 0:
        first = args.node_rank * args.ranks_per_node
        print(
            f"sglang_lite node {args.node_rank}: world ranks [{first}, {first + args.ranks_per_node}) {layout}",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(run_node(args))
    print(
        f"sglang_lite server: http://{args.host}:{args.port} {layout}", file=sys.stderr, flush=True
    )
    run_server(args)


if __name__ == "__main__":
    main()
