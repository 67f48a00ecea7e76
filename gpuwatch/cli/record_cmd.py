"""``gpuwatch record``: write live uevents as JSON lines, the exact ``file:PATH`` source format.

A recording made on a real host replays through ``--source file:PATH`` unchanged, which
is how host-specific bugs become tests. Each line is flushed as written so the command
can feed a pipe. SIGINT/SIGTERM end it normally (exit 0): stopping a recording is its
usual end, not a failure; the lines already read still go out, for up to 2 s.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import signal
import stat
import sys
import threading
from types import FrameType
from typing import TextIO

import anyio

from gpuwatch.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    add_root_args,
    check_root,
    fail,
    to_stderr,
)
from gpuwatch.lograte import RateLimitedLog
from gpuwatch.ownership import open_owned, others_choose
from gpuwatch.sources import (
    EventSource,
    SourceOverflow,
    SourceReadError,
    SourceUnavailable,
    open_source,
)
from gpuwatch.sources.jsonl import JsonlFileSource, uevent_to_json
from gpuwatch.watch.eventlog import ThreadedWriter

log = logging.getLogger("gpuwatch.sources")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "record",
        description="Write each uevent the source delivers as one JSON object a line, "
        "flushed per line, until SIGINT/SIGTERM or the source ends (after a signal, the "
        "lines already read are still written, for up to 2 s).",
    )
    add_root_args(p, config=False)
    p.add_argument(
        "--source",
        default="auto",
        metavar="SPEC",
        help="auto, udev, kernel or file:PATH (default auto = kernel; udev needs udevd)",
    )
    p.add_argument(
        "--out",
        default="-",
        metavar="PATH",
        help="file to write (truncated; refused where another user could choose the "
        "file, as in their directory); - for stdout (the default)",
    )
    p.set_defaults(func=run)


#: What may wait for a slow reader of the recording before reading the source pauses.
_OUT_BUFFER = 1 << 20
#: How often a recording whose reader is behind looks whether there is room again.
_OUT_POLL = 0.01
#: After SIGINT/SIGTERM, how long the lines already read may take to reach the reader: a
#: stop loses nothing a reader takes in time, and one that takes nothing holds no exit
#: longer (a second signal ends the wait at once).
_STOP_GRACE = 2.0


async def record(source: EventSource, out: TextIO | ThreadedWriter, *,
                 limit: int | None = None) -> int:
    """Write the source's events to ``out`` until it ends or ``limit`` events are written.

    Returns how many were written. Lost events (an overflow) cannot be recorded; they are
    logged so the gap in the recording is not silent (a burst of lines, then one a second
    with a count of the rest). A `ThreadedWriter` as ``out`` writes
    from its own thread: a reader that stops reading pauses the recording (the kernel then
    queues, or drops and says so) but never the event loop, so a signal still ends it.
    """
    written = 0
    if limit is not None and limit <= 0:
        return 0
    # A storm against a small receive buffer is a loss per drain: a line each would flood.
    gaps = RateLimitedLog(log, subject="about lost uevents")
    batches = source.batches()
    try:
        async for item in batches:
            if isinstance(item, SourceOverflow):
                gaps.warning("record: events were lost (%s; %d queued dropped); the recording "
                             "has a gap", item.error, item.dropped)
                continue
            for ev in item:
                line = uevent_to_json(ev) + "\n"
                if isinstance(out, ThreadedWriter):
                    await _hand_over(out, line.encode("utf-8"))
                else:
                    out.write(line)
                    out.flush()
                written += 1
                if limit is not None and written >= limit:
                    return written
    finally:
        aclose = getattr(batches, "aclose", None)
        if aclose is not None:
            await aclose()
    return written


async def _hand_over(writer: ThreadedWriter, data: bytes) -> None:
    """``data`` to the writer once it has room (a write error is raised here)."""
    while True:
        try:
            writer.submit(data)
            return
        except BlockingIOError:
            await anyio.sleep(_OUT_POLL)


async def _written(writer: ThreadedWriter) -> None:
    """Until everything handed over is written (a write error is raised here)."""
    while writer.pending():
        await anyio.sleep(_OUT_POLL)


def _writer_for(out: TextIO) -> ThreadedWriter | None:
    """A writer thread for ``out``'s descriptor; None when it has none (a test's capture)."""
    try:
        fd = out.fileno()
    except (OSError, ValueError):
        return None
    out.flush()  # anything already written through it goes first
    return ThreadedWriter(fd, _OUT_BUFFER)


async def _record_until_signal(source: EventSource,
                               out: TextIO) -> OSError | SourceReadError | None:
    """Run ``record`` until the source ends or SIGINT/SIGTERM arrives.

    Returns a write/read error instead of raising it, so it does not come out of the
    task group wrapped in an ExceptionGroup.
    """
    error: OSError | SourceReadError | None = None
    signalled = False

    async def stop_on_signal(scope: anyio.CancelScope) -> None:
        nonlocal signalled
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                signalled = True
                scope.cancel()
                return

    writer = _writer_for(out)
    async with anyio.create_task_group() as tg:
        tg.start_soon(stop_on_signal, tg.cancel_scope)
        try:
            try:
                await record(source, out if writer is None else writer)
            except SourceReadError as exc:
                error = exc  # what was read before it is still written, below
            if writer is not None:
                await _written(writer)  # the source ended: the reader gets it all
        except OSError as exc:
            error = error or exc
        finally:
            tg.cancel_scope.cancel()
    if writer is not None:
        try:
            # A signal: the lines read so far still go out, for `_STOP_GRACE` at most.
            # Else the source ended (all written) or writing failed (nothing to wait for).
            writer.close(_STOP_GRACE if signalled else 0)
        finally:
            writer.close(0)  # a second signal during the wait: drop the rest at once
    return error


def _reads_back(source: EventSource, out: os.stat_result) -> bool:
    """Whether the output ``out`` (a stat) is the file or FIFO a ``file:`` source reads.

    Then the recording would read its own lines back: ``--out`` naming the file truncates
    it first (the recording is lost), stdout appending to it (``>> capture.jsonl``) or the
    same FIFO copy each line again and again, forever. A terminal named twice is fine.
    """
    if not isinstance(source, JsonlFileSource):
        return False
    if not (stat.S_ISREG(out.st_mode) or stat.S_ISFIFO(out.st_mode)):
        return False
    try:
        return os.path.samestat(os.stat(source.path), out)
    except OSError:
        return False


def _open_out(path: str) -> TextIO:
    """``--out`` opened to be written from its start, as root may run ``record``: a path
    another user could choose the file of (their directory, a link of theirs in /tmp) is
    refused, a link planted in /tmp meanwhile is not followed, and the file is emptied only
    once it is known to be ours (an ``O_TRUNC`` open would empty a hard link planted there
    to a file of root's before anything could be checked)."""
    why = others_choose(path)
    if why is not None:
        raise OSError(errno.EPERM, f"{why}, so another user could choose the file it names")
    fd = open_owned(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.ftruncate(fd, 0)
        return open(fd, "w", encoding="utf-8")  # the caller closes it
    except BaseException:
        os.close(fd)
        raise


def _stat_path(path: str) -> os.stat_result | None:
    """``path``'s stat through any link; None when it does not exist (yet)."""
    try:
        return os.stat(path)
    except (OSError, ValueError):
        return None


def _stat_fd(out: TextIO) -> os.stat_result | None:
    """The stat of ``out``'s descriptor; None when it has none (a test's capture)."""
    try:
        return os.fstat(out.fileno())
    except (OSError, ValueError):
        return None


class _Stop(BaseException):
    """SIGINT or SIGTERM before the recording's own signal receiver runs: while the source
    or ``--out`` is opened (a FIFO waits for its reader there) or the loop starts."""


def _stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def run(args: argparse.Namespace) -> int:
    """Record until the source ends or a signal; a signal at any moment is a normal end."""
    previous = {}
    if threading.current_thread() is threading.main_thread():  # signal() works only there
        previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run(args)
    except _Stop:
        return EXIT_OK
    finally:
        for sig, handler in previous.items():  # None: set outside Python, default then
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def _run(args: argparse.Namespace) -> int:
    if args.root is not None:  # as every command: a root that is no folder is a usage error
        check_root(args.root)
    try:
        # No rescan covers a loss here: what the kernel queued before it is still recorded.
        source = open_source(args.source, args.root, keep_queued=True)
        source.start()
    except SourceUnavailable as exc:
        return fail(f"record: {exc}", EXIT_USAGE)
    try:
        for warning in source.warnings:
            to_stderr(f"gpuwatch: record: warning: {warning}")
        if args.out == "-":
            if sys.stdout is None:
                return fail("record: stdout is closed; name a file with --out PATH", EXIT_USAGE)
            target = _stat_fd(sys.stdout)
            if target is not None and _reads_back(source, target):
                return fail("record: stdout is the --source file itself; the recording "
                            "would read its own lines back", EXIT_USAGE)
            out = sys.stdout
        else:
            target = _stat_path(args.out)
            if target is not None and _reads_back(source, target):
                return fail(f"record: --out {args.out!r} is the --source file itself", EXIT_USAGE)
            try:
                out = _open_out(args.out)
            except OSError as exc:
                return fail(f"record: cannot write {args.out!r}: {exc.strerror}", EXIT_USAGE)
        try:
            error = anyio.run(_record_until_signal, source, out)
        except KeyboardInterrupt:
            error = None  # SIGINT before the signal receiver was installed: a normal end
        finally:
            if out is not sys.stdout:
                try:
                    out.close()
                except OSError as exc:
                    # After a failed write the close retries the same bytes and fails
                    # again: the first error is the one to report.
                    error = error or exc
        if isinstance(error, SourceReadError):
            return fail(f"record: {error}", EXIT_FAILURE)
        if isinstance(error, BrokenPipeError):
            # The reader went away (``| head``): done. Silence the flush at exit.
            with contextlib.suppress(OSError):
                sys.stdout = open(os.devnull, "w")  # noqa: SIM115
            return EXIT_OK
        if error is not None:
            where = "stdout" if args.out == "-" else repr(args.out)
            return fail(f"record: cannot write {where}: {error.strerror or error}", EXIT_FAILURE)
        return EXIT_OK
    finally:
        source.close()
