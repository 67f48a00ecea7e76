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
import time
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
    ThreadedWriter,
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
                   help="keep printing new events until SIGINT/SIGTERM or until stdout's reader "
                        "leaves; waits for PATH to appear")
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


#: Bytes of lines that may wait for a slow reader of ``--follow``'s stdout; past it the
#: follower reads no further until the reader takes some.
_OUT_BUFFER = 1 << 20
#: How long, after SIGTERM/SIGINT, the lines handed over may still take to reach the reader.
_STOP_GRACE = 2.0
#: Between looks at a full writer (room again, or a signal).
_OUT_POLL = 0.05


class _AgainSignal(Exception):
    """A second SIGINT/SIGTERM while the last lines wait for the reader: drop them now."""


def _follow(path: str, since_seq: int | None, types: frozenset[str] | None) -> int:
    """Follow the log until SIGINT/SIGTERM or the reader leaves.

    stdout is written by a thread of its own (`ThreadedWriter`, as ``record`` does): a
    reader that stops reading (its pipe full) would otherwise hold this thread in
    ``write()``, which a signal only interrupts to restart, so SIGTERM never ended it."""
    stopping = threading.Event()
    closing = False
    out_fd = _stdout_fd()
    writer = _writer_for(out_fd)
    failed: list[OSError] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if closing:
            raise _AgainSignal
        stopping.set()

    def stop() -> bool:
        if stopping.is_set() or reader_left(out_fd):
            return True
        if writer is not None:
            try:
                writer.pending()  # a write the thread found failing (ENOSPC), said here
            except OSError as exc:
                failed.append(exc)
                return True
        return False

    previous: dict[signal.Signals, _Handler] = {}
    if threading.current_thread() is threading.main_thread():  # signal() works only there
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        records = follow_records(path, since_seq=since_seq, types=types, stop=stop)
        try:
            if writer is None:
                _emit(records)
            else:
                for record in records:
                    if not _hand_over(writer, (record.line + "\n").encode("utf-8"), stopping):
                        break
        except KeyboardInterrupt:  # a SIGINT that landed before the handler was in place
            pass
        if failed:
            if isinstance(failed[0], BrokenPipeError):
                raise failed[0]  # the dispatcher's business: the reader left, exit quietly
            raise _OutputFailed(failed[0])
    finally:
        if writer is not None:
            closing = True
            try:
                # A signal: the lines handed over still go out, for `_STOP_GRACE` at most.
                writer.close(_STOP_GRACE if stopping.is_set() else 0)
            except _AgainSignal:
                pass
            finally:
                writer.close(0)
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    return EXIT_OK


def _writer_for(fd: int | None) -> ThreadedWriter | None:
    """A writer thread for stdout's descriptor; None when it has none (a test's capture)."""
    if fd is None:
        return None
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()  # anything already written through it goes first
    return ThreadedWriter(fd, _OUT_BUFFER)


def _hand_over(writer: ThreadedWriter, data: bytes, stopping: threading.Event) -> bool:
    """``data`` to the writer once it has room; False when a signal came first (a write
    error is raised here)."""
    while True:
        try:
            writer.submit(data)
            return True
        except BlockingIOError:
            if stopping.is_set():
                return False
            time.sleep(_OUT_POLL)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise _OutputFailed(exc) from None


def main(argv: Sequence[str] | None = None) -> int:
    """``gpuwatch events`` on its own (tests, scripts that want no other subcommand)."""
    parser = OneLineParser(prog="gpuwatch")
    register(parser.add_subparsers(dest="command", parser_class=OneLineParser))
    args = parser.parse_args(["events", *(sys.argv[1:] if argv is None else argv)])
    code: int = args.func(args)
    return code
