"""The command line's parser class, apart from `gpuwatch.cli.common`: a command the stdlib
fast paths answer (``status``, ``probe``… with a daemon up) parses its own plain words and
never needs argparse, nor the cost of importing it."""

from __future__ import annotations

import argparse
from typing import NoReturn

from gpuwatch.errors import EXIT_USAGE


class OneLineParser(argparse.ArgumentParser):
    """argparse prints a usage block on error; automation wants one line and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


__all__ = ["OneLineParser"]
