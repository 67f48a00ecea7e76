"""What subcommands share: a parser that fails in one line, --root/--config, exit codes."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

#: Documented exit codes (docs/cli.md).
EXIT_OK = 0
EXIT_FAILURE = 1  # the request was fine but the host said no: not found, not root, refused, failed
EXIT_USAGE = 2  # the request was wrong: bad flag, bad address, bad config


class OneLineParser(argparse.ArgumentParser):
    """argparse prints a usage block on error; automation wants one line and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def add_root_args(parser: argparse.ArgumentParser, *, config: bool = True) -> None:
    parser.add_argument(
        "--root",
        default="/",
        metavar="DIR",
        help="host root holding sys/, proc/, dev/ (default /; a fixture for tests)",
    )
    if config:
        parser.add_argument(
            "--config",
            metavar="FILE",
            default=None,
            help="YAML file overriding the data tables (and watch options)",
        )


def check_root(root: str) -> None:
    if not os.path.isdir(root):
        raise UsageProblem(f"--root {root!r} is not a directory")


class UsageProblem(Exception):
    """Raised by a subcommand for a usage error found after parsing (exit 2)."""


def fail(message: str, code: int) -> int:
    print(f"gpuwatch: {message}", file=sys.stderr)
    return code
