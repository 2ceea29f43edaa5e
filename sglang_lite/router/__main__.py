"""python -m sglang_lite.router --worker-urls http://127.0.0.1:30001 http://127.0.0.1:30002 --policy power_of_two"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys

from .config import config_from_args


def main(argv: list[str] | None = None) -> None:
    """Bad arguments: one line, exit status 2. A start-up that fails (a port in use, a worker that refuses the
    key or never becomes ready): one line, exit status 1; the traceback only under --log-level debug."""
    config = config_from_args(argv)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if config.pd_disaggregation and not (config.prefill and config.decode):
        print(
            "python -m sglang_lite.router: error: --pd-disaggregation needs at least one --prefill "
            "and one --decode worker",
            file=sys.stderr,
        )
        sys.exit(2)
    # after argument parsing, so --help stays instant (aiohttp is imported here)
    from .app import serve

    try:
        with contextlib.suppress(KeyboardInterrupt):
            _run(serve(config))
    except Exception as error:  # noqa: BLE001 - one line for the user, the traceback at debug
        if config.log_level == "debug":
            logging.getLogger("sglang_lite.router").exception("start-up failed")
        print(f"router: error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)


def _loop_factory():
    try:
        import uvloop  # optional: a faster event loop when installed
    except ImportError:
        return None
    return uvloop.new_event_loop


def _run(main_coro) -> None:
    factory = _loop_factory()
    if factory is None or sys.version_info < (3, 11):
        asyncio.run(main_coro)
        return
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main_coro)


if __name__ == "__main__":
    main()
