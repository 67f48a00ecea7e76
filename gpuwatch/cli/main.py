"""Entry point of the ``gpuwatch`` command: parse, dispatch, and map errors to exit codes.

Nothing escapes as a traceback: every error becomes one line on stderr and a documented
exit code (docs/cli.md). ``GPUWATCH_DEBUG=1`` shows the traceback of an unexpected error.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import traceback
from collections.abc import Sequence

from gpuwatch.cli.common import EXIT_FAILURE, OneLineParser, fail
from gpuwatch.errors import GpuwatchError

#: Subcommand modules, in the order ``gpuwatch --help`` lists them.
SUBCOMMANDS = (
    "probe_cmd",
    "status_cmd",
    "list_cmd",
    "watch_cmd",
    "events_cmd",
    "record_cmd",
    "udev_rules_cmd",
    "mode_cmd",
    "plan_cmd",
    "recover_cmd",
    "holders_cmd",
    "ensure_cdi_cmd",
    "service_cmd",
    "health_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="gpuwatch",
        description="Watch a Linux GPU host: probes from memory, change events, safe driver "
        "switching.",
    )
    from gpuwatch import __version__

    parser.add_argument("--version", action="version", version=f"gpuwatch {__version__}")
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=OneLineParser
    )
    subparsers.required = True
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"gpuwatch.cli.{name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # A probe the daemon answers takes the stdlib-only path: no parser of every subcommand,
    # no pydantic (gpuwatch.cli.fast); anything it does not answer comes back here.
    from gpuwatch.cli.fast import run_fast

    fast = run_fast(sys.argv[1:] if argv is None else argv)
    if fast is not None:
        return fast
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "resolve_root", False) and args.root is None:
            # The daemon's root: a direct run and the daemon must look at the same host.
            from gpuwatch.settings import root_in_force

            args.root = root_in_force(None, getattr(args, "config", None))
        code: int = args.func(args)
        return code
    except GpuwatchError as exc:  # UsageError, ConfigError, ...: the code says which exit
        return fail(str(exc), exc.exit_status)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (``| head``); nothing more to say to it.
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        return 0
    except Exception as exc:
        if os.environ.get("GPUWATCH_DEBUG"):
            traceback.print_exc()
        return fail(
            f"internal error: {type(exc).__name__}: {exc} (GPUWATCH_DEBUG=1 shows more)",
            EXIT_FAILURE,
        )
