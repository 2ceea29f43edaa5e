"""What the command-line entry points share: parsing that reports a bad argument in one line (argparse prints
the whole usage first, which for a server's hundred flags buries the message), start-up errors, and the
listening socket bound first."""

from __future__ import annotations

import argparse
import socket
import sys
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr, ``PROG: error: MESSAGE (see --help)``, and exit
    status 2, as argparse's own."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr, flush=True)
        sys.exit(2)


class StartupError(RuntimeError):
    """A start-up failure the user can fix; its message (one line) says how."""


def listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on ``host:port``, bound before anything slow starts, so a port in use is reported at
    once; connections made before the server serves wait in its backlog."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise StartupError(
            f"cannot listen on {host}:{port}: {error.strerror or error} "
            "(another server there? choose one with --port)"
        ) from None
    sock.listen(backlog)
    sock.set_inheritable(False)
    return sock
