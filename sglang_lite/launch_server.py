"""``python -m sglang_lite.launch_server``: the HTTP server with its DP scheduler processes.

Every ServerArgs field is a flag (``--dp-size 2 --port 30000 --api-key KEY ...``); see ``--help``.
"""
from __future__ import annotations

import argparse
import atexit
import logging
import sys

from sglang_lite.server_args import ServerArgs


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    parser = argparse.ArgumentParser(description="sglang_lite HTTP server (SGLang-native and OpenAI-compatible API)")
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    namespace = parser.parse_args(argv)
    logging.basicConfig(level=namespace.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return ServerArgs.from_cli_args(namespace)


def run_server(args: ServerArgs) -> None:
    import uvicorn

    from sglang_lite.server.http_server import create_app
    from sglang_lite.utils.process import stop_processes

    app = create_app(args)
    manager = app.state.manager

    def stop_ranks() -> None:  # even if uvicorn exits abnormally
        if manager.client is not None:
            stop_processes(manager.client.processes, grace_s=0.0)

    atexit.register(stop_ranks)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=30)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"sglang_lite server: http://{args.host}:{args.port} dp_size={args.dp_size}", file=sys.stderr, flush=True)
    run_server(args)


if __name__ == "__main__":
    main()
