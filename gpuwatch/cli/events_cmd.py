"""``gpuwatch events PATH``: print (and with ``--follow``, tail) the JSONL event log.

Lines go out exactly as stored, one per event, flushed each, so the command can sit in a
pipe and be parsed line by line. ``--follow`` ends cleanly on SIGINT/SIGTERM (exit 0):
stopping a tail is its normal end, not a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

from gpuwatch.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    fail,
    one_line,
)
from gpuwatch.cli.oneline import OneLineParser
from gpuwatch.core.events import EVENT_TYPES
from gpuwatch.watch.eventlog import (
    EventRecord,
    follow_records,
    not_a_log_file,
    read_records,
    reader_left,
    rotated_path,
)

# What signal.signal() hands back: a callable, SIG_DFL/SIG_IGN, or None (set outside Python).
_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "events",
        description="Print events from a gpuwatch JSONL event log (rotated files included, "
        "oldest first), optionally following it as it grows and rotates.",
    )
    p.add_argument("path", metavar="PATH", help="the event log (PATH.1, PATH.2, ... are read too)")
    p.add_argument("--follow", "-f", action="store_true",
                   help="keep printing new events until SIGINT/SIGTERM; waits for PATH to appear")
    p.add_argument("--since-seq", type=int, metavar="N", default=None,
                   help="only events with seq > N")
    p.add_argument("--type", action="append", metavar="T", dest="types", default=None,
                   help="only events of this type (repeatable, or comma separated)")
    p.set_defaults(func=run)


def _parse_types(values: list[str] | None) -> frozenset[str] | None:
    """``--type a,b --type c`` as a set; None = no filter. Raises ValueError on a bad name."""
    if values is None:
        return None
    names = {name.strip() for value in values for name in value.split(",")}
    names.discard("")
    if not names:
        raise ValueError("--type needs at least one event type")
    unknown = sorted(names - EVENT_TYPES)
    if unknown:
        # A typo would otherwise print nothing, forever with --follow.
        raise ValueError(f"unknown event type {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(sorted(EVENT_TYPES))})")
    return frozenset(names)


class _OutputFailed(Exception):
    """Writing stdout failed (a full disk, a closed descriptor): said as such, not blamed
    on the log being read."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror or str(error))


def _emit(records: Iterator[EventRecord]) -> None:
    out = sys.stdout
    assert out is not None  # run() refused a closed stdout
    for record in records:
        try:
            out.write(record.line + "\n")
            out.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise _OutputFailed(exc) from None


class _Notes(logging.Handler):
    """What the reader has to say about the log (a rotated name that is no log file and is
    skipped, a new run of the watcher) goes to stderr, one line each: stdout is events."""

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(OSError, ValueError):
            print(f"gpuwatch: events: {one_line(record.getMessage())}", file=sys.stderr,
                  flush=True)


def run(args: argparse.Namespace) -> int:
    logger = logging.getLogger("gpuwatch.watch.eventlog")
    notes, level = _Notes(logging.INFO), logger.level
    logger.addHandler(notes)
    if level == logging.NOTSET or level > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        return _run(args)
    finally:
        logger.removeHandler(notes)
        logger.setLevel(level)


def _run(args: argparse.Namespace) -> int:
    try:
        types = _parse_types(args.types)
    except ValueError as exc:
        return fail(f"events: {exc}", EXIT_USAGE)
    path: str = args.path
    if not path:
        # No file can ever be named so: --follow would wait for it for ever.
        return fail("events: PATH must not be empty", EXIT_USAGE)
    if sys.stdout is None:
        return fail("events: stdout is closed", EXIT_USAGE)
    why = not_a_log_file(path)  # else it would read as an empty log, silently
    if why is not None:
        return fail(f"events: {why}", EXIT_FAILURE)
    try:
        if not args.follow:
            # exists, not lexists: a link to nowhere is no log either (was: nothing, exit 0).
            if not (os.path.exists(path) or os.path.exists(rotated_path(path, 1))):
                return fail(f"events: no event log at {path}", EXIT_FAILURE)
            _emit(read_records(path, since_seq=args.since_seq, types=types))
            return EXIT_OK
        return _follow(path, args.since_seq, types)
    except _OutputFailed as exc:
        return fail(f"events: cannot write to stdout: {exc}", EXIT_FAILURE)
    except OSError as exc:
        if isinstance(exc, BrokenPipeError):
            raise  # the dispatcher's business: the reader left, exit quietly
        return fail(f"events: {exc.filename or path}: {exc.strerror or exc}", EXIT_FAILURE)


def _stdout_fd() -> int | None:
    try:
        return sys.stdout.fileno() if sys.stdout is not None else None
    except (OSError, ValueError, AttributeError):  # a stream without one (a test's capture)
        return None


def _follow(path: str, since_seq: int | None, types: frozenset[str] | None) -> int:
    stopping = threading.Event()
    out_fd = _stdout_fd()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    previous: dict[signal.Signals, _Handler] = {}
    if threading.current_thread() is threading.main_thread():  # signal() works only there
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        _emit(follow_records(path, since_seq=since_seq, types=types,
                             stop=lambda: stopping.is_set() or reader_left(out_fd)))
    except KeyboardInterrupt:  # a SIGINT that landed before the handler was in place
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """``gpuwatch events`` on its own (tests, scripts that want no other subcommand)."""
    parser = OneLineParser(prog="gpuwatch")
    register(parser.add_subparsers(dest="command", parser_class=OneLineParser))
    args = parser.parse_args(["events", *(sys.argv[1:] if argv is None else argv)])
    code: int = args.func(args)
    return code
