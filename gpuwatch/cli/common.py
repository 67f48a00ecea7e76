"""What subcommands share: a parser that fails in one line, --root/--config, exit codes."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

# Documented exit codes, one table with the error codes (gpuwatch.errors): 0 done, 1 the
# request was fine but the host said no (not found, not root, refused, failed), 2 the
# request was wrong (bad flag, bad address, bad config).
from gpuwatch.core.limits import MAX_SECONDS
from gpuwatch.core.text import terminal_safe
from gpuwatch.errors import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, UsageError

if TYPE_CHECKING:
    import argparse

    from gpuwatch.settings import ConfigInForce

# argparse is imported where a parser is built or an argument parsed (`gpuwatch.cli.oneline`,
# the types below): the stdlib fast paths import this module and parse their own words.


def add_root_args(parser: argparse.ArgumentParser, *, config: bool = True) -> None:
    """``--root`` and (``config``) ``--config``. Before the command runs, `gpuwatch.cli.main`
    reads the config file in force once into ``args.config_in_force`` (see `config_of`) and
    fills in ``args.root``."""
    parser.add_argument(
        "--root",
        default=None,
        metavar="DIR",
        help="host root holding sys/, proc/, dev/ (default: the daemon's, $GPUWATCH_ROOT or "
             "the config file's root, else /; a fixture for tests)",
    )
    parser.set_defaults(resolve_root=True)
    if config:
        parser.add_argument(
            "--config",
            metavar="FILE",
            default=None,
            help="YAML file overriding the data tables (and watch options); default "
                 "$GPUWATCH_CONFIG, else /etc/gpuwatch/config.yaml when it exists, as the "
                 "daemon reads it",
        )


def config_of(args: argparse.Namespace) -> ConfigInForce | str | None:
    """What a command passes on as its ``config``: the one read of the file in force that
    `gpuwatch.cli.main` made (``args.config_in_force``), else ``--config`` as given (a
    command run without `gpuwatch.cli.main`, which then reads it itself)."""
    read: ConfigInForce | None = getattr(args, "config_in_force", None)
    return read if read is not None else getattr(args, "config", None)


def check_root(root: str, where: str | None = None) -> None:
    """A root that is no folder is a usage error, blamed on what named it: ``--root``, or
    ``where`` (``environment GPUWATCH_ROOT``, ``FILE: root``), as every bad setting is."""
    if not os.path.isdir(root):
        raise UsageProblem(f"--root {root!r} is not a directory" if where is None
                           else f"{where}: {root!r} is not a directory")


def positive_seconds(text: str) -> float:
    """argparse type: a timeout (> 0) of the other commands (``--timeout``)."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number of seconds")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text!r} must be at most {MAX_SECONDS:g} (a week)")
    return value


class UsageProblem(UsageError):
    """Raised by a subcommand for a usage error found after parsing (exit 2)."""


__all__ = ["EXIT_FAILURE", "EXIT_OK", "EXIT_USAGE"]


def fail(message: str, code: int) -> int:
    """Say why in one line on stderr, and return ``code``: the status says it whether or
    not anyone reads stderr (``2>&1 | head`` may have left; a lost line is no success)."""
    to_stderr(f"gpuwatch: {one_line(message)}")
    return code


def to_stderr(line: str) -> None:
    """One line to stderr, never an error of its own: a note or a warning that cannot be
    said (stderr closed, or its reader gone) must not end the command, nor change its
    status. Nothing more goes to stderr then, nor at exit's flush."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        with contextlib.suppress(OSError):
            sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the process's life


class _WarningLines(logging.Handler):
    """gpuwatch's own warnings during a command, each one line on stderr as the command's
    errors are (``gpuwatch: warning: …``): without it Python's last-resort handler writes the
    bare message, a control character in a host's file name included."""

    def emit(self, record: logging.LogRecord) -> None:
        to_stderr(f"gpuwatch: warning: {one_line(record.getMessage())}")


@contextlib.contextmanager
def warnings_to_stderr() -> Iterator[None]:
    """Say gpuwatch's warnings (a switch record ignored, a service that would not stop) for
    the command's life (`mode`, `recover`: the daemon, `watch`, sets up its own logging)."""
    logger = logging.getLogger("gpuwatch")
    handler = _WarningLines(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def one_line(text: str) -> str:
    """``text`` with each character that is not printable (a newline, a terminal escape)
    written as its escape: an error naming what a hostile file or argument holds stays one
    line, and says nothing to the terminal."""
    return terminal_safe(text, keep="")
