"""Command-line parsing that reports a bad argument in one line (argparse prints the whole usage first, which
for a server's hundred flags buries the message)."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr, ``PROG: error: MESSAGE (see --help)``, and exit
    status 2, as argparse's own."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr, flush=True)
        sys.exit(2)
