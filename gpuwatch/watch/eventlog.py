"""The JSONL event log: one event per line, rotated by size, readable while it is written.

The writer appends each event with one ``write`` on an ``O_APPEND`` descriptor and rotates
*between* events (close, rename ``PATH.(K-1)->PATH.K`` … ``PATH->PATH.1``, open a new
``PATH``), so a file only ever ends in the middle of a line while that line is being
written. Readers rely on exactly that: a line counts once its newline is on disk, a torn
tail is waited for (follow) or left out (one-shot read), and a follower that sees ``PATH``
name a different inode knows the old file is complete, drains it, then moves on.

``seq`` grows by one per event across the whole log, which is what lets readers skip
duplicates when a rotation races their directory scan.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import math
import os
import re
import select
import stat
import sys
import threading
import time
from collections import deque
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Collection,
    Generator,
    Iterator,
    Sequence,
)
from types import TracebackType
from typing import IO, Any, NamedTuple

import anyio

from gpuwatch.core import strictjson
from gpuwatch.core.limits import MAX_LOG_KEEP
from gpuwatch.core.ndjson import LineFramer
from gpuwatch.errors import EVENT_LOG, HostError, InternalError, UsageError
from gpuwatch.hostfs.files import flock_holder
from gpuwatch.ownership import not_ours, open_owned, others_choose
from gpuwatch.sources.turns import end_turn
from gpuwatch.watch.handover import LOG_GAP, Handover, gap_span

__all__ = [
    "EventLog",
    "EventLogClosedError",
    "EventLogLocked",
    "EventLogUnavailable",
    "EventLogWriteError",
    "EventRecord",
    "RawChunk",
    "ThreadedWriter",
    "afollow_events",
    "afollow_records",
    "follow_events",
    "follow_records",
    "last_seq_in",
    "not_a_log_file",
    "read_chunks",
    "read_events",
    "read_records",
    "reader_left",
    "rotated_path",
]

_log = logging.getLogger(__name__)

# How much one poll reads before handing events out: keeps the async follower from
# holding the event loop for a whole backlog, and bounds memory per batch.
_POLL_BUDGET = 256 * 1024
_CHUNK = 64 * 1024
# One slice of a socket replay (`read_chunks`): ~50 µs of work on a real log (most of it
# `_plain_heads` vouching for its lines; `detect-vfio` lines cost twice a `driver-changed`'s
# per byte), so a request that arrives meanwhile waits no longer than that for its turn of
# the event loop. 8 KiB doubled a probe's p99 during a paced replay of a real log.
_REPLAY_CHUNK = 4 * 1024
# A rotation renames one file at a time, so a directory scan can meet one hole (the name
# just vacated); two consecutive missing names mean the end of the rotated set.
_MAX_GAP = 2
#: A follower holds at most this much of one unfinished line; a longer line is no event
#: gpuwatch wrote (events are a few hundred bytes) and is skipped like any garbage line.
MAX_EVENT_LINE = 16 << 20
# A scan that raced a completed rotation is redone; after this many tries the seq guard
# alone keeps the output duplicate-free.
_SCAN_ATTEMPTS = 5
#: The records that open or close a run of the watcher. Within one log their seqs only grow:
#: one whose seq is not above the last seq read (and that is not a line read before, which a
#: scan racing a rotation can meet again) starts a new run, whose seqs began again at 1 (the
#: log's files were deleted or replaced before the watcher restarted).
_RUN_EDGES = frozenset({"ready", "stopped"})
#: How many ``ready``/``stopped`` lines a reader remembers to tell a line read again from a
#: new run's line (a bound: each run adds two).
_RUN_MARKS = 4096

_Ident = tuple[int, int]
#: How much of the start of the file a follower keeps to notice it was emptied in place and
#: written anew: a first record's ``{"seq":N,"time":"…"`` with room to spare.
_HEAD_BYTES = 128
#: How many files' first bytes a follower remembers to know a rotated file it met before
#: when the file it stops its rescans at is gone (`_Follower._known_heads`).
_KNOWN_HEADS = 4096


class EventLogClosedError(InternalError, ValueError):
    """``write_line`` after ``close``: the event would otherwise vanish silently."""


class EventLogUnavailable(HostError):
    """The log path cannot be opened for writing (no permission, a directory, read-only…)."""

    code = EVENT_LOG


class EventLogLocked(EventLogUnavailable):
    """Another process writes this log (it holds ``PATH.lock``); two writers would
    interleave lines and repeat seqs, so the second one stops before writing anything."""


class EventLogWriteError(HostError, OSError):
    """A write failed (ENOSPC, EIO, …); of the failed batch, only its first
    ``lines_written`` lines are known to be on disk in full (a short write can land whole
    lines before the disk fills). The log stays usable: the next write tries again."""

    code = EVENT_LOG
    #: How many whole lines of the batch reached the file before the failure.
    lines_written = 0


def lock_path(path: str | os.PathLike[str]) -> str:
    """The lock file beside a log: ``PATH.lock``."""
    return os.fspath(path) + ".lock"


def _describe_os_error(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "")
    text = exc.strerror or str(exc)
    return f"{name}: {text}" if name else text


def _names_a_stream(path: str) -> bool:
    """Whether ``path`` is a FIFO or a device (a terminal, /dev/null): written, never rotated
    or read back, so no ``PATH.lock`` beside it (none can be made in /dev/pts, and a root
    daemon would leave /dev/null.lock in /dev). stat opens nothing: a FIFO never blocks."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode)


def _others_control_log(path: str) -> str | None:
    """Why another user could choose what the log ``path`` names (`others_choose`; None: no
    one can). Root would otherwise append its events wherever they point it."""
    try:
        return others_choose(path)
    except OSError as exc:
        # A directory not there or not readable: the open that follows says so.
        return None if exc.errno in (errno.ENOENT, errno.EACCES, errno.ENOTDIR) else \
            f"{path}: {_describe_os_error(exc)}"


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def not_a_log_file(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` can hold no log (``"PATH is a directory, not an event log file"``), or
    None when it may: a regular file (a link to one counts), or nothing there (no file yet,
    a dangling link). The one rule readers and the writer share: what it names is never
    read, moved or deleted as part of the log."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "not a file")
    return f"{os.fspath(path)} is {kind}, not an event log file"


#: Rotated names a socket replay already warned about: (path, device, inode). Each reader
#: warns once; replays share this, so clients asking again and again (each a new reader)
#: do not repeat it in the daemon's journal. Bounded.
_replay_warned: dict[tuple[str, int, int], None] = {}
_WARNED_MAX = 256


def _warn_skipped(warned: dict[tuple[str, int, int], None], name: str, why: str,
                  st: os.stat_result) -> None:
    key = (name, st.st_dev, st.st_ino)
    if key in warned:
        return
    if len(warned) >= _WARNED_MAX:
        del warned[next(iter(warned))]
    warned[key] = None
    _log.warning("%s: skipped (the log's other files are read)", why)


#: Bytes of log lines that may wait for a slow stdout reader (`ThreadedWriter`); past it a
#: batch is refused like a failed write (the log degrades, and resumes with ``log-gap``).
STDOUT_BUFFER = 4 << 20
#: How long closing the log waits for stdout's reader to take what is left: ``stopped``
#: goes out if it reads at all, and a stalled one does not hold the exit past SIGTERM's 2 s.
_STDOUT_CLOSE_WAIT = 1.0
#: Between tries of a write to stdout that failed (a full disk behind it).
_STDOUT_RETRY = 1.0


class ThreadedWriter:
    """Writes bytes to a descriptor (stdout, mostly) from a daemon thread of its own.

    stdout is often a pipe shared with other processes (a shell pipeline, systemd's stream
    to the journal): making it ``O_NONBLOCK`` would change it for every one of them. It stays
    as it is, and this thread is the only one that waits on it: the watcher hands a batch
    over and goes on, so a reader that stops reading never stops the model, the socket or
    the probes (and ``gpuwatch record`` still ends on SIGTERM; a daemon thread stuck in a
    write does not hold the process's exit). Bounded: once `limit` bytes wait, `submit`
    refuses (EAGAIN), which the watcher takes as any failed write (``log-degraded``, then a
    ``log-gap`` record when there is room again). Bytes handed over are never dropped
    before `close`, nor torn: a failed write (ENOSPC) is tried again, from where it
    stopped, while `submit` and `pending` raise its error.
    """

    def __init__(self, fd: int, limit: int) -> None:
        self.fd = fd
        self._limit = limit
        self._cond = threading.Condition()
        self._queue: deque[memoryview] = deque()
        self._queued = 0
        self._error: OSError | None = None  # the last write failed so (cleared by a success)
        self._broken = False  # the reader has gone (EPIPE): nothing will be written again
        self._closing = False
        self._dropped = False  # closed: what is left is not written
        self._done = False  # the thread has ended
        self._thread: threading.Thread | None = None

    def submit(self, data: bytes) -> None:
        """Hand ``data`` (whole lines) over, or raise without taking any of it.

        A pipe whose reader has gone (``gpuwatch watch | head -1``) is `BrokenPipeError`
        here, at once: left to the thread's write, the batch would be taken, the error
        found after it, and the caller told only with the batch after that, which on a
        quiet host may be a reconcile or two away."""
        with self._cond:
            if self._closing:
                raise ValueError("the writer is closed")
            if not self._broken and reader_left(self.fd):
                # What is queued is left to the thread (it may be writing it now): its next
                # write finds EPIPE and drops the rest.
                self._broken = True
            self._raise()
            if self._queued and self._queued + len(data) > self._limit:
                raise BlockingIOError(
                    errno.EAGAIN, f"the reader is not reading ({self._queued} bytes wait)")
            self._queue.append(memoryview(data))
            self._queued += len(data)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="gpuwatch-writer")
                self._thread.start()
            self._cond.notify_all()

    def pending(self) -> int:
        """Bytes handed over and not yet written; raises as `submit` does when writing
        them fails."""
        with self._cond:
            self._raise()
            return self._queued

    def _raise(self) -> None:
        if self._broken:
            raise BrokenPipeError(errno.EPIPE, "the reader has gone")
        if self._error is not None:  # still failing: the caller degrades now
            raise OSError(self._error.errno, self._error.strerror)

    def close(self, wait: float) -> tuple[int, OSError | None]:
        """Stop once what is handed over is written, waiting at most ``wait`` seconds:
        (bytes still unwritten then, which are dropped; the error writing them, if any)."""
        deadline = time.monotonic() + wait
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            while self._queue and not self._done:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            unwritten, error = self._queued, self._error
            # Dropped: the thread writes nothing more (a write under way ends on its own),
            # so the descriptor may be closed and its number reused.
            self._dropped = True
            self._queue.clear()
            self._queued = 0
            self._cond.notify_all()
            return unwritten, error

    def _run(self) -> None:
        try:
            self._write_queued()
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def _write_queued(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                view = self._queue[0]
            try:
                written = os.write(self.fd, view)  # the only wait on the reader
            except BlockingIOError:  # another process made the shared stdout O_NONBLOCK
                _wait_writable(self.fd, _STDOUT_RETRY)
                continue
            except BrokenPipeError:
                with self._cond:
                    self._broken = True
                    self._queue.clear()
                    self._queued = 0
                    self._cond.notify_all()
                return
            except OSError as exc:
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                    if not self._closing:
                        self._cond.wait(_STDOUT_RETRY)
                    if self._closing and self._error is not None:
                        return  # still failing at close: what is left is dropped
                continue
            with self._cond:
                if self._dropped:
                    return
                self._error = None
                self._queued -= written
                if written >= len(view):
                    self._queue.popleft()
                else:
                    self._queue[0] = view[written:]
                self._cond.notify_all()


def reader_left(fd: int | None) -> bool:
    """Whether ``fd`` is a pipe whose reader has gone (``… | head -1``): the kernel reports
    an error on its write end at once, so a writer learns it without writing (and waiting
    for a line to fail). Anything else (a file, a terminal, no descriptor) never reads as
    gone."""
    if fd is None:
        return False
    poller = select.poll()
    poller.register(fd, 0)  # no events asked: only an error or a hang-up is reported
    try:
        return any(mask & select.POLLERR for _, mask in poller.poll(0))
    except OSError:
        return False


def _wait_writable(fd: int, timeout: float) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    with contextlib.suppress(OSError):
        poller.poll(timeout * 1000)


def _take_lock(path: str) -> tuple[int | None, int | None]:
    """Hold ``PATH.lock`` exclusively, and the log's directory shared, for the life of the
    writer: (the lock file's descriptor, the directory's). The lock file names our pid.

    Both are taken where the log really is (PATH's links resolved), so two writers that
    name one log by two names (a link to it) meet on one lock. flock, not a pid file
    alone: the kernel drops the lock when the holder dies (even by kill -9), so a stale
    file never blocks a restart. On a full disk the lock file may not be creatable; the
    directory is then locked exclusively instead, which conflicts with every writer's
    shared hold of it: the same log's (whoever comes first), and, the price of the
    fallback, other logs' in that directory.
    """
    real = os.path.realpath(path)
    name = lock_path(real)
    directory = os.path.dirname(real)
    fd: int | None = None
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise EventLogUnavailable(
                f"event log {path}: cannot open its lock {name}: {_describe_os_error(exc)}"
            ) from None
        no_lock_file = _describe_os_error(exc)
    # Planted in a sticky directory (/tmp): a file of another user's, or a hard link to a
    # file of root's, whose first bytes our pid and seq records would overwrite.
    whose = None if fd is None else not_ours(os.fstat(fd))
    if fd is not None and whose is not None:
        os.close(fd)
        raise EventLogUnavailable(f"event log {path}: its lock {name} {whose}; not using it")
    dir_fd: int | None = None
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECTORY)
    except OSError as exc:
        if fd is None:
            raise EventLogUnavailable(
                f"event log {path}: cannot make its lock {name} ({no_lock_file}) nor open "
                f"{directory} to lock it instead: {_describe_os_error(exc)}") from None
        # A directory we may not read: the lock file alone (no fallback writer can lock
        # that directory either: it could not open it).
    try:
        if fd is not None:
            _flock(fd, fcntl.LOCK_EX, path, name,
                   lambda who: f"event log {path} is written by {who} (it holds {name}); "
                               "one log has one writer")
        if dir_fd is not None and fd is not None:
            _flock(dir_fd, fcntl.LOCK_SH, path, directory,
                   lambda who: f"event log {path}: its directory {directory} is locked by "
                               f"{who}, a writer there that could not make its lock file "
                               "(a full disk); one log has one writer")
        elif dir_fd is not None:
            _flock(dir_fd, fcntl.LOCK_EX, path, directory,
                   lambda who: f"event log {path}: its lock {name} cannot be made "
                               f"({no_lock_file}), and {directory}, locked instead, has "
                               f"another writer ({who}); one log has one writer")
    except BaseException:
        for held in (fd, dir_fd):
            if held is not None:
                os.close(held)
        raise
    if fd is not None:
        with contextlib.suppress(OSError):  # the pid is a courtesy: a full disk may refuse it
            # Padded, not truncated: the seq record after it (`_SEQ_AT`) outlives the writer.
            pid = f"{os.getpid()}\n".ljust(_SEQ_AT).encode()
            os.pwrite(fd, pid, 0)
    return fd, dir_fd


def _flock(fd: int, how: int, path: str, name: str, refusal: Callable[[str], str]) -> None:
    """``flock(fd, how)`` without waiting, or `EventLogLocked` with ``refusal(holder)``."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise EventLogLocked(refusal(flock_holder(fd))) from None
        raise EventLogUnavailable(
            f"event log {path}: cannot lock {name}: {_describe_os_error(exc)}") from None


#: Where ``PATH.lock`` holds the highest seq published while the log could not be written
#: (`EventLog.hold_seq`): after the pid, a fixed-size record overwritten in place, so a
#: full disk (which refused the log's lines) cannot refuse it once the file has it.
_SEQ_AT = 32
_SEQ_RECORD = 32


#: The highest seq a lock file's record may hold: a JSON number past it is no exact
#: integer to many readers (doubles), and numbering after it would leave int64.
MAX_HELD_SEQ = 2**53 - 1


def _read_held_seq(fd: int, path: str = "") -> int:
    """The seq record of a lock file (0: none, or not a file: the directory fallback). A
    record above `MAX_HELD_SEQ` is damage, not a seq: ignored, with a warning."""
    with contextlib.suppress(OSError, ValueError):
        if stat.S_ISREG(os.fstat(fd).st_mode):
            text = os.pread(fd, _SEQ_RECORD, _SEQ_AT).decode("ascii").strip()
            if text.isdigit():
                seq = int(text)
                if seq <= MAX_HELD_SEQ:
                    return seq
                _log.warning("event log %s: the seq held in its lock file (%s) is above "
                             "2**53 - 1; ignored", path, text)
    return 0


class RawChunk(NamedTuple):
    """A run of stored lines for a replay, byte for byte: the events with seq ``first`` …
    ``last``, every one of them, were read (all after the previous chunk's: a hole in the
    log falls between two chunks, never inside one), ``data`` holds the lines of those
    wanted, each ending in ``\n`` (maybe none), each one `_decode` takes for an event."""

    first: int
    last: int
    data: bytes
    #: A ``log-gap`` record's chunk (it holds that one line, ``first`` = ``last`` = its
    #: seq): the first seq of the hole it names (`gap_span`), which the log lacks up to
    #: ``last``. 0 for any other chunk.
    gap: int = 0


#: What `_Follower.read_chunk` returns after a read that completed no event line (inside a
#: long line, a crash's NULs): no seqs (``first`` 0), so that a caller ends its turn
#: between any two reads however much such a log holds.
_PROGRESS = RawChunk(0, 0, b"")

#: Bytes every ``log-gap`` line holds, however it is spaced (the writer's own spelling, or a
#: hand-edited line's ``"type": "log-gap"``): a line with them is decoded, never vouched for.
_GAP_MARK = f'"{LOG_GAP}"'.encode()


class EventRecord(NamedTuple):
    """One event as decoded, plus its line exactly as stored (for byte-exact relaying)."""

    event: dict[str, Any]
    line: str


def rotated_path(path: str | os.PathLike[str], index: int) -> str:
    """``PATH`` for index 0, ``PATH.N`` otherwise: the one naming rule writer and readers share."""
    base = os.fspath(path)
    return base if index == 0 else f"{base}.{index}"


# --------------------------------------------------------------------------- parsing


#: What a line that may be an event starts with: JSON's whitespace, then an object.
_OBJECT_START = re.compile(rb"[ \t\r\n]*\{")


def _decode(raw: bytes) -> tuple[dict[str, Any], str] | None:
    """A stored line as (event, text), or None when it is not one (never raises: logs get
    damaged, and a follower must outlive a bad line).

    Decoded strictly (`strictjson`): a line with ``NaN``, ``Infinity``, a number out of
    range, a duplicate key or a lone surrogate is no line the writer wrote but damage, and
    a replay must neither pass it on nor count its seq as held (it is a hole)."""
    if _OBJECT_START.match(raw) is None:
        return None  # no object: not decoded (15 MiB of NULs cost the decoder 0.2 s)
    try:
        text = raw.decode("utf-8")
        obj = strictjson.loads(text)
    except (ValueError, RecursionError):  # UnicodeDecodeError, JSONDecodeError; UnsafeJson
        return None
    if not isinstance(obj, dict):
        return None
    seq = obj.get("seq")
    if (not isinstance(seq, int) or isinstance(seq, bool) or seq < 1
            or not isinstance(obj.get("type"), str)):
        return None  # seqs start at 1: a writer must never continue below it
    return obj, text


def _plain_line_pattern() -> re.Pattern[bytes]:
    """One line as the writer writes it (``{"seq":N,"time":…,"type":…,…}``), its seq
    captured, or any other line, with nothing captured: over bytes `_plain_heads` has
    screened (printable ASCII and newlines, no backslash), a line it captures is JSON that
    `strictjson` accepts.

    A grammar for a part of JSON: strings without escapes, numbers that cannot overflow a
    float (at most 200 digits before an exponent of at most 2: no ``1e999``; no ``NaN`` or
    ``Infinity``, which are no JSON), ``true``/``false``/``null``, and arrays and objects 4
    deep at most. Possessive quantifiers: a line is matched or refused without going back.
    A string is ``[^"]*``, the regex engine's quickest loop; one that runs on past a newline
    makes a match of two lines, which `_plain_heads` counts and refuses. One thing the
    grammar cannot see: a key twice over in one object (which no crash or disk error
    writes). The seq is bounded as a number is: a longer one (`strictjson` refuses past
    309 digits, and `int` raises past 4,300) is left to the strict decoder.
    """
    string = rb'"[^"]*+"'
    number = rb"-?+(?:0|[1-9][0-9]{0,199}+)(?:\.[0-9]++)?+(?:[eE][+-]?+[0-9]{1,2}+)?+"
    scalar = string + rb"|" + number + rb"|true|false|null"
    value = rb"(?:" + scalar + rb")"
    for _ in range(3):
        value = (rb"(?:" + scalar + rb"|\[(?:" + value + rb"(?:," + value + rb")*+)?+\]"
                 rb"|\{(?:" + string + rb":" + value + rb"(?:," + string + rb":" + value
                 + rb")*+)?+\})")
    seq = rb"[1-9][0-9]{0,199}+"  # as a number's digits: `int` takes it, and a float
    return re.compile(rb'\{"seq":(' + seq + rb'),"time":' + string + rb',"type":' + string
                      + rb"(?:," + string + rb":" + value + rb")*+\}\n|[^\n]*+\n")


_PLAIN_LINE = _plain_line_pattern()
#: The bytes a plain line is made of (see `_plain_heads`): printable ASCII, and the newline.
_PLAIN_BYTES = bytes(range(0x20, 0x7F)).replace(b"\\", b"") + b"\n"


def _plain_heads(lines: bytes) -> list[bytes] | None:
    """One item per line of ``lines`` (whole lines): the seq of a line the writer wrote
    and whose bytes alone prove it strict JSON with a whole seq and a string type (what
    `_decode` takes for an event), or ``b""`` for a line that must be decoded to be judged.
    None when nothing can be vouched for: a byte that is not printable ASCII (bytes that
    are not UTF-8, a control byte) or a backslash (an escape, maybe a lone surrogate) is in
    them, which the replay's fast path leaves to `_decode`.

    Three passes in C (the screen, `_PLAIN_LINE`, the count), about twice the cost of
    the byte counting they replace, for the guarantee that what a replay sends as stored
    is what the strict decoder takes. A line nested deeper than the pattern reaches (a
    ``detect-vfio`` `probe-changed`) is then vouched for by `_vouch_deep`, at about a third
    of what decoding it strictly costs.
    """
    if lines.translate(None, _PLAIN_BYTES):  # what is left is no plain byte
        return None
    heads = _PLAIN_LINE.findall(lines)
    if len(heads) != lines.count(b"\n"):
        return None
    if b"" in heads:
        _vouch_deep(lines, heads)
    return heads


#: Digits as ``0`` (and ``E`` as ``e``, ``+`` as ``0``): a number that may not be finite
#: then shows as one of two byte runs.
_NUMBERS_AS_ZEROS = bytes.maketrans(b"123456789E+", b"000000000e0")
#: What a number needs to overflow a float: an exponent of three digits or more (``+`` read
#: as a digit: ``1e+99`` counts too), or 200 digits in a row (with an exponent of two,
#: ``1e199`` times ``1e99`` is still finite).
_LONG_EXPONENT = b"0e000"
_LONG_DIGITS = b"0" * 200


def _may_overflow(raw: bytes) -> bool:
    """Whether ``raw`` may hold a number a float cannot hold (conservative: a string with
    such a run counts too, and its line is then decoded, not vouched for)."""
    zeros = raw.translate(_NUMBERS_AS_ZEROS)
    return _LONG_EXPONENT in zeros or _LONG_DIGITS in zeros


#: Nesting `strictjson` refuses (its default), checked only for lines that open more.
_MAX_DEPTH = strictjson.MAX_DEPTH


def _vouch_deep(lines: bytes, heads: list[bytes]) -> None:
    """Give the seq of each line `_PLAIN_LINE` left out (``b""`` in ``heads``) that the
    writer wrote all the same: an event nested deeper than the pattern reaches, as every
    ``detect-vfio`` `probe-changed` is (its GPUs' group members; their SR-IOV VFs), the
    biggest lines of a real log. The pattern stays shallow because it doubles with each
    level it reaches (and so does its compile time).

    ``lines`` passed the screen (printable ASCII, no backslash: no escape, so no lone
    surrogate, and no byte that is not UTF-8), so what is left for pydantic-core's parser
    (C, no ``NaN`` or ``Infinity`` allowed) to settle is what it lets through and
    `strictjson` does not: a number out of range (screened out by its bytes first), nesting
    deeper than `strictjson`'s limit (measured when a line opens that many brackets) and a
    key twice over (not seen, as by the pattern: `_plain_line_pattern`)."""
    from_json = _from_json()
    split = lines.split(b"\n")
    index = -1
    while True:
        try:
            index = heads.index(b"", index + 1)
        except ValueError:
            return
        raw = split[index]
        if (not raw.startswith(b'{"seq":')  # no line the writer writes
                or _may_overflow(raw)
                or (raw.count(b"[") + raw.count(b"{") > _MAX_DEPTH and _too_deep(raw))):
            continue
        try:
            obj = from_json(raw, allow_inf_nan=False)
        except ValueError:
            continue
        seq = obj.get("seq") if type(obj) is dict else None
        if type(seq) is int and seq >= 1 and type(obj.get("type")) is str:
            heads[index] = b"%d" % seq


def _too_deep(raw: bytes) -> bool:
    """Whether a screened line (no escapes, so no quote inside a string) nests deeper than
    `_MAX_DEPTH` (or is unbalanced): its brackets outside strings, innermost pairs taken
    away a level at a time."""
    # Quotes and brackets only, a string without a bracket is then ``""``: when every such
    # pair goes, no quote is left and what is left are the brackets outside strings.
    brackets = raw.translate(None, _NOT_QUOTES_OR_BRACKETS).replace(b'""', b"")
    if b'"' in brackets:  # a string holds a bracket: drop every string the long way
        brackets = b"".join(raw.split(b'"')[::2]).translate(None, _NOT_BRACKETS)
    for _ in range(_MAX_DEPTH):
        if not brackets:
            return False
        brackets = _EMPTY_PAIR.sub(b"", brackets)  # both kinds at once: one level a pass
    return bool(brackets)


_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
_NOT_QUOTES_OR_BRACKETS = bytes(set(range(256)) - set(b'"[]{}'))
_EMPTY_PAIR = re.compile(rb"\[\]|\{\}")


def _from_json() -> Callable[..., Any]:
    """pydantic-core's parser, imported where a replay first needs it."""
    from pydantic_core import from_json

    return from_json


def _reverse_lines(f: IO[bytes]) -> Iterator[bytes]:
    """Complete lines of ``f`` from last to first; a tail without newline is torn and skipped.

    Each byte is read once and at most `MAX_EVENT_LINE` bytes of one line are held: a line
    longer than that is no event and is passed over (a crash can leave megabytes of NULs,
    without a newline, at the end of a file that was being appended to).
    """
    pos = f.seek(0, os.SEEK_END)
    line: list[bytes] = []  # the pieces of the line in hand, last piece first
    held = 0
    past_tail = False  # a newline was met: the bytes after the file's last one are behind us
    skipping = False  # the line in hand outgrew MAX_EVENT_LINE: its bytes are dropped
    while pos > 0:
        step = min(_CHUNK, pos)
        pos -= step
        f.seek(pos)
        pieces = f.read(step).split(b"\n")
        head = pieces.pop(0)  # what precedes this chunk's first newline (or all of it)
        if pieces:  # the line in hand ends the last piece: it starts after a newline here
            last = pieces.pop()
            if past_tail and not skipping and held + len(last) <= MAX_EVENT_LINE:
                line.append(last)
                yield b"".join(reversed(line))
            past_tail, skipping = True, False
            yield from reversed(pieces)  # whole lines between this chunk's newlines
            line, held = [], 0
        if past_tail and not skipping:
            held += len(head)
            if held > MAX_EVENT_LINE:
                line, held, skipping = [], 0, True
            else:
                line.append(head)
    if past_tail and not skipping:
        yield b"".join(reversed(line))


def _open_log_file(path: str) -> tuple[IO[bytes], os.stat_result] | None:
    """``path`` opened for reading with its stat; None when it does not exist.

    Raises `OSError` (naming the file) for anything but a regular file. A FIFO, socket or
    device is never read: opening a FIFO would wait until a writer came, and reading one
    would take the bytes meant for its own reader (a watcher may be writing events there).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        # A socket (ENXIO) or a device without its driver cannot even be opened: still what
        # is there is no log file, which readers skip at a rotated name like any other.
        try:
            st = os.stat(path)
        except OSError:
            raise exc from None
        if stat.S_ISREG(st.st_mode):
            raise
        raise _NotALogFile(exc.errno or errno.EINVAL, "not a regular file", path, st) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise _NotALogFile(errno.EISDIR, os.strerror(errno.EISDIR), path, st)
        if not stat.S_ISREG(st.st_mode):
            raise _NotALogFile(errno.EINVAL, "not a regular file", path, st)
        os.set_blocking(fd, True)
    except OSError:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb", buffering=0), st


class _WrittenByAnother(OSError):
    """The log file opened is flocked by another writer (`EventLog._open`): not ours to
    write. ``who`` names the holder (``pid N``)."""

    def __init__(self, code: int, text: str, who: str) -> None:
        super().__init__(code, text)
        self.who = who


class _NotALogFile(OSError):
    """A directory, FIFO, socket or device where a log file should be (its stat kept)."""

    def __init__(self, code: int, text: str, path: str, st: os.stat_result) -> None:
        super().__init__(code, text, path)
        self.st = st


def _last_seq_of_file(path: str) -> int | None:
    try:
        opened = _open_log_file(path)
    except OSError:
        return None  # a directory or a FIFO where a rotated file should be: no seq there
    if opened is None:
        return None
    with opened[0] as f:
        return _last_seq_of(f)


#: How far back from a file's end the search for its last event goes (`_last_seq_of`):
#: past it, the file's tail is taken as unreadable (`_TailTooLong`).
LAST_SEQ_SCAN = 64 << 20
#: And how many lines that start like a record but are none it decodes before that.
_LAST_SEQ_CANDIDATES = 65536
#: How each line the writer writes starts (``{"seq":N,…``; ``{"seq": N`` too).
_RECORD_START = b'{"seq"'
_LINE_START = b"\n" + _RECORD_START


class _TailTooLong(Exception):
    """The last event of a file was not found within `LAST_SEQ_SCAN` bytes of its end."""


def _last_seq_of(f: IO[bytes]) -> int | None:
    """The seq of the last event line in ``f`` (None: no event in it), searched backwards
    from its end for a line that starts ``{"seq"`` (``rfind``, in C), decoding only those:
    a tail of lines that are no event costs a read, not a decode a line. Raises
    `_TailTooLong` past `LAST_SEQ_SCAN` bytes (or `_LAST_SEQ_CANDIDATES` lines that look
    like records) without one, so that the cost is bounded however long the junk."""
    pos = f.seek(0, os.SEEK_END)
    line_end: int | None = None  # just past the first newline at or after ``pos`` (None:
    # none yet: what is there is a torn tail)
    after = b""  # the first bytes of the chunk read before (a marker may cross into them)
    scanned = candidates = 0
    while pos > 0:
        if scanned >= LAST_SEQ_SCAN:
            raise _TailTooLong
        step = min(_CHUNK, pos)
        pos -= step
        f.seek(pos)
        chunk = f.read(step)
        if len(chunk) != step:  # shrunk under us: what is read is not where it was
            return None
        scanned += step
        buf = chunk + after
        hi = len(buf)
        while True:
            at = buf.rfind(_LINE_START, 0, hi)
            start = at + 1
            if at < 0:
                if pos > 0 or not buf.startswith(_RECORD_START):
                    break
                start = 0  # the file's first line
            hi = max(at, 0)
            candidates += 1
            if candidates > _LAST_SEQ_CANDIDATES:
                raise _TailTooLong
            nl = buf.find(b"\n", start)
            if nl >= 0:
                raw = buf[start:nl]
            elif line_end is None or line_end - 1 - (pos + start) > MAX_EVENT_LINE:
                raw = b""  # a torn tail, or a line no event is that long
            else:
                f.seek(pos + start)
                raw = f.read(line_end - 1 - (pos + start))
            decoded = _decode(raw) if len(raw) <= MAX_EVENT_LINE else None
            if decoded is not None:
                seq: int = decoded[0]["seq"]
                return seq
            if at < 0:
                break
        first_nl = chunk.find(b"\n")
        if first_nl >= 0:
            line_end = pos + first_nl + 1
        after = chunk[: len(_LINE_START) - 1]
    return None


#: A bisection probe (`_probe`) looks for a line that starts in a window this wide, and
#: reads as much again after it for that line to end in: one read of 64 KiB a probe,
#: however long the junk around it (a longer line is passed over, as junk is).
_PROBE_WINDOW = 32 * 1024

_Found = tuple[int, int]  # an event line's (offset, seq)


def _probe(f: IO[bytes], pos: int, limit: int, *, last: bool = False) -> _Found | None:
    """The first (or ``last``) line that starts in ``[pos, min(pos + window, limit))``,
    ends within a window after it and is an event (`_decode`); None: none.

    ``pos`` is a line start at 0 or after a newline, so the byte before it is read too.
    One read of at most twice `_PROBE_WINDOW` bytes, whatever is around it."""
    base = pos - 1 if pos > 0 else 0
    f.seek(base)
    data = f.read(pos + 2 * _PROBE_WINDOW - base)
    stop = min(pos + _PROBE_WINDOW, limit) - base  # lines that start before it count
    at = 0 if pos == 0 else data.find(b"\n") + 1
    if pos > 0 and at == 0:
        return None  # no newline in all of it: no line starts here
    found: _Found | None = None
    while at < stop:
        nl = data.find(b"\n", at)
        if nl < 0:
            break  # it runs past what was read: no line a probe decodes
        decoded = _decode(data[at:nl])
        if decoded is not None:
            found = (base + at, decoded[0]["seq"])
            if not last:
                break
        at = nl + 1
    return found


def _event_after(f: IO[bytes], pos: int, limit: int) -> _Found | None:
    """The first event that starts in ``[pos, limit)``, in O(log distance) probes however
    much junk lies between: windows ever further out (1, 2, 4 … windows apart) until one
    holds an event, then bisection between it and the last empty one for the first that
    holds one. (An event alone between two empty windows far apart may be passed over for
    a later one: the caller then starts its reader earlier than it might, never later.)"""
    found = _probe(f, pos, limit)
    if found is not None:
        return found
    empty, step = pos, _PROBE_WINDOW  # the window at `empty` holds no event
    while True:
        if empty + _PROBE_WINDOW >= limit:
            return None
        at = max(min(empty + step, limit - _PROBE_WINDOW), empty + _PROBE_WINDOW)
        found = _probe(f, at, limit)
        if found is not None:
            break
        empty, step = at, step * 2
    while at - empty > _PROBE_WINDOW:
        middle = (empty + at) // 2
        nearer = _probe(f, middle, limit)
        if nearer is None:
            empty = middle
        else:
            at, found = middle, nearer
    return found


def _event_before(f: IO[bytes], pos: int, floor: int) -> _Found | None:
    """The last event that starts in ``[floor, pos)``: `_event_after` the other way."""
    empty, step = pos, _PROBE_WINDOW  # no event starts in [empty, pos)
    while True:
        if empty <= floor:
            return None
        at = max(empty - step, floor)
        found = _probe(f, at, empty, last=True)
        if found is not None:
            break
        empty, step = at, step * 2
    while empty - at > _PROBE_WINDOW:
        middle = (at + empty) // 2
        nearer = _probe(f, middle, empty, last=True)
        if nearer is None:
            empty = middle
        else:
            at, found = middle, nearer
    return found


def _offset_after_seq(f: IO[bytes], since_seq: int) -> int:
    """Where in ``f`` a reader of ``seq > since_seq`` may start, found by bisection.

    Seqs grow down a log, so this reads O(log size) windows of 64 KiB, not the whole file.
    The offset is that of an event whose seq is at most ``since_seq`` (or 0), so at or
    before the first wanted line: the reader's own ``seq`` filter drops the few earlier
    lines it may still meet, and it reads whatever junk lies between. An event whose seq is
    ``since_seq + 1`` is the first wanted one (seqs grow by one an event): it starts there.

    Junk (a crash's NULs, lines that are no event, a region without a newline) never makes
    a step read through it: a probe that lands in it looks for the nearest event on each
    side in O(log junk) windows (`_event_after`, `_event_before`), and when those two
    bracket ``since_seq`` the search ends there.
    """
    end = f.seek(0, os.SEEK_END)
    start, lo, hi = 0, 0, end
    while hi - lo > _PROBE_WINDOW:
        mid = (lo + hi) // 2
        after = _event_after(f, mid, hi)
        if after is not None and after[1] <= since_seq + 1:
            if after[1] == since_seq + 1:
                return after[0]
            start, lo = after[0], after[0] + 1
            continue
        if after is not None and after[0] < mid + _PROBE_WINDOW:
            hi = mid  # an event near mid, past since_seq: what is wanted is before it
            continue
        before = _event_before(f, mid, lo)  # mid is in junk: what ends it on the left?
        if before is None or before[1] <= since_seq:
            return start if before is None else before[0]
        if before[1] == since_seq + 1:
            return before[0]
        hi = before[0]
    return start


def _start_file(sources: Sequence[_Source], since_seq: int) -> int:
    """The index of the file (oldest first) a replay after ``since_seq`` starts in: the
    newest whose first event (as `_event_after` finds it from its head) is at most
    ``since_seq + 1``, so every earlier file holds only events a reader drops. Not where
    the seqs go back at its start (an event near the end of the file before it is at or
    past that one, as when a writer numbered after a tail it gave up on): a linear read
    keeps the earlier file's events there, so the search goes on before it. O(log size)
    windows a file looked at, however much junk a file ends (or starts) in."""
    def found(src: _Source, last: bool) -> int | None:
        at = src.file.tell()  # a file read on from where it was: put back where it was
        end = src.file.seek(0, os.SEEK_END)
        event = _event_before(src.file, end, 0) if last else _event_after(src.file, 0, end)
        src.file.seek(at)
        return None if event is None else event[1]

    index = len(sources) - 1
    while index > 0:
        first = found(sources[index], last=False)
        if first is not None and first <= since_seq + 1:
            before = found(sources[index - 1], last=True)
            if before is None or before < first:
                return index
        index -= 1
    return 0


def last_seq_in(path: str | os.PathLike[str]) -> int | None:
    """The newest ``seq`` in the log: ``PATH``, else the newest rotated file that has one.

    Read backwards from the end, so it costs the same for a 1 KiB and a 1 GiB log, and
    at most `LAST_SEQ_SCAN` bytes a file: past them without an event it gives up on that
    file's tail rather than hold a starting daemon for a tail of junk. Giving up is not
    "no event": the file's head and the older files still hold seqs a new run must not
    reuse, so the newest of those is taken (a lower bound, with a warning); None (number
    from 1, with a warning) only when none of them holds one.
    """
    index, misses = 0, 0
    gave_up: list[str] = []
    floor = 0  # the newest seq at the head of a file whose tail was given up
    found: int | None = None
    while misses < _MAX_GAP:
        name = rotated_path(path, index)
        index += 1
        if not os.path.exists(name):
            misses += 1
            continue
        misses = 0
        try:
            found = _last_seq_of_file(name)
        except _TailTooLong:
            gave_up.append(name)
            floor = max(floor, _head_seq_of_file(name))
            continue
        if found is not None:
            break
    if not gave_up:
        return found
    best = max(found or 0, floor)
    if best:
        _log.warning("event log %s: no event in the last %d MiB of %s; numbering after seq "
                     "%d, the newest found before it (the log may hold later ones)", path,
                     LAST_SEQ_SCAN >> 20, ", ".join(gave_up), best)
        return best
    _log.warning("event log %s: no event in the last %d MiB of %s; numbering as if the log "
                 "held none", path, LAST_SEQ_SCAN >> 20, ", ".join(gave_up))
    return None


def _head_seq_of_file(path: str) -> int:
    """The newest seq among the whole lines of ``path``'s first `_CHUNK` bytes (0: none):
    one read, for a file whose tail `_last_seq_of` gave up on."""
    try:
        opened = _open_log_file(path)
    except OSError:
        return 0
    if opened is None:
        return 0
    with opened[0] as f:
        try:
            head = f.read(_CHUNK)
        except OSError:
            return 0
    newest = 0
    for raw in head.split(b"\n")[:-1]:  # the last piece may be cut by the read
        if raw.startswith(_RECORD_START):
            decoded = _decode(raw)
            if decoded is not None:
                newest = max(newest, int(decoded[0]["seq"]))
    return newest


# --------------------------------------------------------------------------- writer


class EventLog:
    """Appends event lines to PATH ('-' = stdout), flushed per event; rotates at max_bytes
    keeping `keep` old files PATH.1..PATH.K (PATH.1 newest).

    A PATH that is no regular file (a FIFO with a reader, ``/dev/null``, a terminal) is a
    stream, like stdout (`replayable` is False): written, never rotated (renaming a device
    node would replace it with a plain file), never read back, and a FIFO is written
    without blocking (a reader that stops reading degrades the log instead of freezing the
    watcher). stdout, which other processes share, stays blocking and is written by a
    thread of its own (`ThreadedWriter`), to the same end.

    Thread-safe: one lock orders writes and rotations, so lines never interleave.
    ``last_seq`` is read once at open; numbering after that is the caller's.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, max_bytes: int | None = None, keep: int = 5,
        lock: bool = True,
    ) -> None:
        if max_bytes is not None and max_bytes <= 0:
            raise UsageError(f"max_bytes must be positive, got {max_bytes}")
        if not 0 <= keep <= MAX_LOG_KEEP:
            raise UsageError(f"keep must be from 0 to {MAX_LOG_KEEP}, got {keep}")
        self._stdout = os.fspath(path) == "-"
        self._path = os.fspath(path)
        self._max_bytes = None if self._stdout else max_bytes
        #: The size PATH rotates at: max_bytes, or past a failed rotation, max_bytes more.
        self._rotate_at = self._max_bytes
        self._keep = keep
        self._lock = threading.Lock()
        self._fd: int | None = None
        #: (st_dev, st_ino) of the file ``_fd`` writes: PATH naming another (or none) means
        #: the file was deleted or renamed away under the writer (`_follow_path`).
        self._ident: _Ident | None = None
        #: PATH was a regular file when first opened: a reopen must find one there again.
        self._regular = False
        self._size = 0
        self._closed = False
        self._last_seq: int | None = None
        self._lock_fd: int | None = None
        #: The seq `hold_seq` last stored in ``PATH.lock`` (0: none).
        self._held_seq = 0
        #: ``PATH.lock`` ends before its seq record (made on a full disk: its pid and record
        #: could not be written): a hold cannot be kept until both are (`_store_seq`).
        self._lock_short = False
        #: Seqs an earlier writer published and never wrote (`unwritten`).
        self._unwritten: tuple[int, int] | None = None
        self._lines_written = 0  # whole lines of the batch under way on disk
        self._dir_lock_fd: int | None = None  # the log's directory, held shared (`_take_lock`)
        #: Why the last write failed (None while writes succeed): a full disk, EIO, …
        self.error: str | None = None
        self._check_tail = True  # before the next write: end a torn last line
        #: PATH is a FIFO or a device: no rotation, no read-back (see the class docstring).
        self._stream = self._stdout
        #: Whether the last byte written ended a line (what a stream's torn check uses).
        self._tail_newline = True
        #: The thread that writes stdout's lines (`--log -`), made at the first write.
        self._stdout_writer: ThreadedWriter | None = None
        #: Each log file opened is flocked too (`_open`): PATH.lock guards a name, and a
        #: name can come to mean another writer's file (a link, a rotated or re-made dir).
        self._locking = lock
        #: Past the first open: a file another writer holds is then a failed write, said once.
        self._started = False
        self._told_held = False
        if self._stdout:
            if sys.stdout is None:  # started with fd 1 closed: every event would fail
                raise EventLogUnavailable("event log -: stdout is closed")
            return
        parent = os.path.dirname(self._path)
        try:
            if parent:
                os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
                raise EventLogUnavailable(
                    f"event log {self._path}: cannot create {parent}: "
                    f"{_describe_os_error(exc)}") from None
        why = _others_control_log(self._path)
        if why is not None:
            raise EventLogUnavailable(
                f"event log {self._path}: {why}, so another user could choose the file "
                "it names; not writing there")
        if lock and not _names_a_stream(self._path):
            self._lock_fd, self._dir_lock_fd = _take_lock(self._path)  # before any write
        try:
            self._open()
            self._end_torn_line()
        except _WrittenByAnother as exc:
            self._release_lock()
            raise EventLogLocked(
                f"event log {self._path} is written by {exc.who} (it holds the file itself "
                "locked); one log has one writer") from None
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR,
                             errno.EROFS, errno.ELOOP, errno.ENOENT, errno.ENXIO):
                self._release_lock()
                raise EventLogUnavailable(
                    f"event log {self._path}: cannot open it for writing: "
                    f"{_describe_os_error(exc)}") from None
            # A full or failing disk: serve anyway, the writes are retried (degraded start).
            self.error = _describe_os_error(exc)
            _log.warning("event log %s: %s; starting without it", self._path, self.error)
        self._started = True
        self._last_seq = None if self._stream else last_seq_in(self._path)
        if self._lock_fd is not None:
            # A writer that stopped while its disk was full published seqs past the file's
            # end: number after them too, or a seq would name two events.
            with contextlib.suppress(OSError):
                st = os.fstat(self._lock_fd)
                self._lock_short = (stat.S_ISREG(st.st_mode)
                                    and st.st_size < _SEQ_AT + _SEQ_RECORD)
            held = _read_held_seq(self._lock_fd, self._path)
            if held > (self._last_seq or 0):
                self._unwritten = ((self._last_seq or 0) + 1, held)
                self._last_seq = held
            # Written now, while the disk may have room: later ones overwrite it in place.
            self._store_seq(held if self._unwritten else 0)

    @property
    def path(self) -> str:
        return self._path

    @property
    def replayable(self) -> bool:
        """Whether readers can replay this log from its files (stdout, a FIFO or a device
        cannot be read back)."""
        return not self._stream

    @property
    def last_seq(self) -> int | None:
        """The last ``seq`` already in the log when it was opened (None: empty or stdout),
        or, when higher, the last one an earlier writer published and could not write
        (`hold_seq`)."""
        return self._last_seq

    @property
    def unwritten(self) -> tuple[int, int] | None:
        """(first, last) seqs an earlier writer published but never wrote (its disk was
        full when it stopped): what the next ``log-gap`` record names. None: no such seqs."""
        return self._unwritten

    def hold_seq(self, seq: int) -> bool:
        """Remember ``seq`` (published, not written) in ``PATH.lock``, in place, where a
        full disk cannot refuse it: the next writer numbers after it (`last_seq`). 0 clears
        it; the next successful write does so too. False: not stored (no lock file, or
        one made on a full disk that cannot take the record yet): a restart may reuse it."""
        with self._lock:
            return self._store_seq(seq)

    def _store_seq(self, seq: int) -> bool:
        fd = self._lock_fd
        if fd is None:
            return False
        record = (f"{seq}" if seq else "").ljust(_SEQ_RECORD - 1).encode() + b"\n"
        at = _SEQ_AT
        if self._lock_short:  # the pid too: a record after a hole names no holder
            record, at = f"{os.getpid()}\n".ljust(_SEQ_AT).encode() + record, 0
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return False  # the directory fallback of `_take_lock`
            if os.pwrite(fd, record, at) != len(record):
                return False
        except OSError:
            return False
        self._lock_short = False
        self._held_seq = seq
        return True

    def _open(self) -> None:
        # O_NONBLOCK for the open only: a FIFO planted at PATH fails with ENXIO instead of
        # hanging the daemon until someone reads it.
        # A FIFO stays non-blocking: a full pipe is a failed write (the log degrades and
        # is retried), never a watcher stuck in write() while its reader sleeps.
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NONBLOCK
        fd = open_owned(self._path, flags, 0o644)
        try:
            st = os.fstat(fd)
            if self._regular and not stat.S_ISREG(st.st_mode):
                # The log was a file: what replaced it (a FIFO, a device) is not the log's,
                # and is not written; the write fails and the log degrades until a file is
                # back.
                why = not_a_log_file(self._path) or f"{self._path} is not a regular file"
                raise OSError(errno.EINVAL, f"{why}: not written")
            if self._locking and stat.S_ISREG(st.st_mode):
                self._lock_file(fd)
        except BaseException:
            os.close(fd)
            raise
        self._told_held = False
        self._stream = not stat.S_ISREG(st.st_mode)
        if not self._stream:
            os.set_blocking(fd, True)
            self._regular = True
        self._fd = fd
        self._ident = (st.st_dev, st.st_ino)
        self._size = st.st_size

    def _lock_file(self, fd: int) -> None:
        """flock the file about to be written, held while it is: PATH.lock alone guards a
        name, and after a reopen or a rotation PATH may name a file another writer holds (a
        link put at PATH, a hard link, a rotated link, a directory re-made). Readers take
        no flock: they are never held up. Raises `_WrittenByAnother` when refused; past the
        start that is a failed write (the log degrades), warned about once."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            who = flock_holder(fd, pid_file=False)
            if self._started and not self._told_held:
                self._told_held = True
                _log.warning("event log %s: the file it names now is written by %s, "
                             "another writer; not written while it is", self._path, who)
            raise _WrittenByAnother(
                exc.errno, f"{self._path} is written by {who}, another writer: not written",
                who) from None

    def _end_torn_line(self) -> None:
        if self._check_tail:
            if self._stream:
                torn = not self._tail_newline  # nothing to read back: what we wrote says
            else:
                torn = self._size > 0 and not self._ends_with_newline()
            if torn:
                # A writer died mid-line (or a write failed half way). End that line so the
                # next event does not fuse with it; readers skip the damaged one.
                self._write_all(b"\n")
            self._check_tail = False

    def _release_lock(self) -> None:
        for fd in (self._lock_fd, self._dir_lock_fd):
            if fd is not None:
                os.close(fd)
        self._lock_fd = self._dir_lock_fd = None

    def _ends_with_newline(self) -> bool:
        with open(self._path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def _write_all(self, data: bytes) -> None:
        """Write ``data`` to the log's descriptor, however short the writes."""
        assert self._fd is not None
        fd = self._fd
        view = memoryview(data)
        done = 0
        while view:  # one write in practice; the loop only matters for a short write
            written = os.write(fd, view)
            if written:
                self._tail_newline = view[written - 1] == 0x0A
                self._lines_written += data.count(b"\n", done, done + written)
            view = view[written:]
            done += written
            self._size += written

    def write_line(self, line: str) -> None:
        """Append ``line`` + newline in one write. Rotates first if it would overflow max_bytes."""
        self.write_lines((line,))

    def write_lines(self, lines: Sequence[str]) -> None:
        """Append several event lines with as few writes as rotation allows (one, usually).

        What the watcher drained as one batch is on disk before it reads the next, so every
        event is still flushed as it is published; a rotation falls between two lines, never
        inside one.
        """
        text = "\n".join(lines)
        if lines and text.count("\n") != len(lines) - 1:  # one scan in C, not one per line
            raise ValueError("an event line must not contain a line break")
        if self._stdout:
            with self._lock:
                if self._closed:
                    raise EventLogClosedError("event log is closed")
                try:
                    self._write_stdout("".join(line + "\n" for line in lines))
                except BrokenPipeError:
                    raise  # the reader left (`| head`): the command's end, not a failure
                except OSError as exc:
                    self.error = _describe_os_error(exc)
                    raise EventLogWriteError(exc.errno, self.error) from None
                self.error = None
            return
        with self._lock:
            if self._closed:
                raise EventLogClosedError(f"event log {self._path} is closed")
            self._lines_written = 0
            try:
                self._append(lines, text)
            except OSError as exc:
                # Anything may be on disk up to the failure, even half a line: look at the
                # tail before the next write. The caller decides what to retry and when.
                self._check_tail = True
                self.error = _describe_os_error(exc)
                error = EventLogWriteError(exc.errno, self.error)
                error.lines_written = self._lines_written
                raise error from None
            self.error = None
            if self._held_seq or self._lock_short:
                # The log holds what it vouched for: nothing is held. A lock file made on a
                # full disk gets its pid and record now there is room, so a later hold can
                # be kept.
                self._store_seq(0)

    def _write_stdout(self, text: str) -> None:
        """``text`` to stdout: straight to its descriptor when it has one, through the
        writer thread (`ThreadedWriter`), so a stalled reader never holds the caller and
        nothing sits in Python's buffer to come out later, after newer lines."""
        out = sys.stdout
        if out is None:
            raise OSError(errno.EBADF, "stdout is closed")
        try:
            fd = out.fileno()
        except (OSError, ValueError):  # not a file (a test's capture, an embedder's stream)
            out.write(text)
            out.flush()
            return
        writer = self._stdout_writer
        if writer is None or writer.fd != fd:
            if writer is not None:  # stdout is another file now: what is left was for the old
                _close_stdout_writer(writer, 0)
            out.flush()  # anything printed before the log's first line goes out before it
            writer = self._stdout_writer = ThreadedWriter(fd, STDOUT_BUFFER)
        writer.submit(text.encode("utf-8"))

    def _append(self, lines: Sequence[str], text: str) -> None:
        """``text`` is ``lines`` joined by newlines."""
        if self._fd is None:
            self._open()  # resuming after a failure (or a failed rotation's reopen)
        elif not self._stream:
            self._follow_path()
        self._end_torn_line()
        self._lines_written = 0  # the lines of this batch, not the torn line's end
        if not lines:
            return
        limit = None if self._stream else self._rotate_at
        if limit is None or self._size + 4 * len(text) + 1 <= limit:
            # The batch fits before the next rotation (UTF-8 takes at most 4 bytes a
            # character): one encode and one write.
            self._write_all((text + "\n").encode("utf-8"))
            return
        pending: list[bytes] = []
        pending_size = 0
        for line in lines:
            data = (line + "\n").encode("utf-8")
            size = self._size + pending_size
            if size > 0 and size + len(data) > limit:
                if pending:
                    self._write_all(b"".join(pending))
                    pending, pending_size = [], 0
                if self._size > 0:
                    self._rotate()
                    assert self._rotate_at is not None
                    limit = self._rotate_at
            pending.append(data)
            pending_size += len(data)
        if pending:
            self._write_all(b"".join(pending))

    def _follow_path(self) -> None:
        """Reopen PATH when it no longer names the file written (deleted, or renamed away
        as by logrotate's ``create`` mode): lines written to that file would reach no
        reader. One ``stat`` a batch; what PATH holds now is opened as at the start."""
        try:
            st = os.stat(self._path)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                return  # cannot tell (no search permission…): keep the file in hand
            now: _Ident | None = None
        else:
            now = (st.st_dev, st.st_ino)
        if now == self._ident:
            if st.st_size != self._size:
                # Another process wrote to the file or emptied it in place (an ``echo >>``,
                # copytruncate). Its size is the file's, for the rotation; bytes it appended
                # may end mid-line, and the next event would fuse with them and be lost to
                # every reader: end that line first, as a writer's own torn line is.
                self._check_tail = True
                self._size = st.st_size
            return
        assert self._fd is not None
        what = "replaced"
        if now is None:
            # A file still linked somewhere was renamed away (`mv PATH PATH.old`): its
            # events are there, and an operator told "deleted" would look for a loss.
            try:
                what = "renamed away" if os.fstat(self._fd).st_nlink else "deleted"
            except OSError:
                what = "deleted or renamed away"
        os.close(self._fd)
        self._fd = self._ident = None
        self._check_tail = True  # a file already there may end in a torn line
        _log.warning("event log %s: %s under the writer; reopening %s", self._path,
                     what, self._path)
        self._open()

    def _rotate(self) -> None:
        assert self._fd is not None and self._max_bytes is not None
        os.close(self._fd)
        self._fd = None
        self._check_tail = False  # the new file starts empty
        failed = False
        try:
            self._shift_files()
        except OSError as exc:
            # Losing events is worse than an oversized file: keep appending to PATH, and try
            # again after another max_bytes, not before every write (a warning and a reopen
            # per event while, say, PATH.1 is a directory).
            failed = True
            _log.warning("event log rotation of %s failed, continuing unrotated until it "
                         "grows by another %d bytes: %s", self._path, self._max_bytes, exc)
        finally:
            self._open()
        self._rotate_at = self._size + self._max_bytes if failed else self._max_bytes

    def _shift_files(self) -> None:
        # What is not a log file (a directory, a FIFO, a device) in a slot a rotation moves
        # or overwrites is not the log's: refuse before moving anything, as readers pass
        # over it. The log keeps growing (see _rotate) until it is taken away.
        for index in range(1, self._keep + 1):
            why = not_a_log_file(rotated_path(self._path, index))
            if why is not None:
                raise OSError(f"{why}: not moved or replaced")
        # Files beyond `keep` (left by a run with a larger keep) go first, so the set on
        # disk is exactly PATH.1..PATH.keep afterwards (what is no log file stays).
        index = self._keep + 1
        while os.path.lexists(rotated_path(self._path, index)):
            if not_a_log_file(rotated_path(self._path, index)) is None:
                os.unlink(rotated_path(self._path, index))
            index += 1
        if self._keep == 0:
            os.unlink(self._path)
            return
        for index in range(self._keep - 1, 0, -1):
            src = rotated_path(self._path, index)
            if os.path.lexists(src):
                os.replace(src, rotated_path(self._path, index + 1))
        os.replace(self._path, rotated_path(self._path, 1))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._release_lock()
            writer, self._stdout_writer = self._stdout_writer, None
        if writer is not None:
            _close_stdout_writer(writer, _STDOUT_CLOSE_WAIT)

    def __enter__(self) -> EventLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# --------------------------------------------------------------------------- readers


class _Source:
    """One open log file being consumed; its framer holds the unfinished last line."""

    __slots__ = ("carry", "consumed", "file", "framer", "head", "ident")

    def __init__(self, file: IO[bytes], ident: _Ident) -> None:
        self.file = file
        self.ident = ident
        self.framer = LineFramer(MAX_EVENT_LINE)
        self.carry = b""  # read_chunk's unfinished last line (its framer is for the rest)
        self.consumed = False
        #: The file's first bytes as last seen (up to `_HEAD_BYTES`): the first record's seq
        #: and time, which a log emptied in place and written anew does not repeat.
        self.head = b""

    def restart(self) -> None:
        """Read the file again from its start: it was emptied in place since."""
        self.file.seek(0)
        self.framer.reset()
        self.carry = b""
        self.head = b""

    def rewritten(self) -> bool:
        """Whether the file was emptied in place and written anew since its head was seen,
        however far the new writes went (past the reader's position too, so its size says
        nothing): its first record is no longer the one read. One small ``pread``."""
        now = os.pread(self.file.fileno(), _HEAD_BYTES, 0)
        if not now.startswith(self.head):
            return True
        self.head = now
        return False


def _close_stdout_writer(writer: ThreadedWriter, wait: float) -> None:
    """Close the stdout writer, giving its reader ``wait`` seconds, and say what was lost."""
    left, error = writer.close(wait)
    if left:
        why = "its reader stopped reading" if error is None else _describe_os_error(error)
        _log.warning("event log -: %s; the last %d bytes of lines are not written", why, left)



def _close_sources(live: _Source | None, rotated: list[_Source]) -> None:
    """Close what a scan opened and will not hand over."""
    for src in [live, *rotated]:
        if src is not None:
            src.file.close()


def _settled_head(f: IO[bytes]) -> bytes:
    """The file's first `_HEAD_BYTES` bytes once appending can no longer change them (they
    reach a newline, or are that many): its first record's seq and time to the
    microsecond, which tell it from every other file of the log, whatever its inode (a
    deleted file's inode is reused). ``b""`` while they can still change."""
    head = os.pread(f.fileno(), _HEAD_BYTES, 0)
    return head if len(head) == _HEAD_BYTES or b"\n" in head else b""


def _stat_ident(path: str) -> _Ident | None:
    try:
        st = os.stat(path)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError) or exc.errno == errno.ELOOP:
            return None  # nothing there, or a link that leads nowhere
        raise
    return (st.st_dev, st.st_ino)


class _Follower:
    """Incremental reader over PATH.K … PATH.1, PATH that survives rotation.

    ``pending`` holds files nobody writes any more (oldest first), read to their end;
    ``live`` is the file PATH named at the last look. The ``anchor`` is the newest file
    seen so far, kept open so its inode cannot be reused, and tells a rescan where the
    already-known files begin.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        since_seq: int | None,
        types: Collection[str] | None,
        *,
        runs: bool = False,
        warned: dict[tuple[str, int, int], None] | None = None,
    ) -> None:
        self._path = os.fspath(path)
        self._since_seq = since_seq
        # The duplicate guard: a scan that raced a rotation may open a file twice.
        self._handover = Handover(since_seq)
        self._types = None if types is None else frozenset(types)
        self._pending: deque[_Source] = deque()
        self._live: _Source | None = None
        self._anchor: _Source | None = None
        self._scanned = False  # read_chunk: the one directory scan of a replay is done
        #: read_chunk: lines after a jump in the seqs, for the next chunk (`_decoded`).
        self._after_jump: list[bytes] = []
        #: Whether a new run of the log (seqs begun again) is followed (see `_fresh`): for
        #: followers, which outlive the watcher's runs. A one-shot read (and a socket
        #: replay) takes the log as it is, each seq once.
        self._runs = runs
        #: Rotated names that are no log file, already warned about (see `_warn_skipped`).
        self._warned: dict[tuple[str, int, int], None] = {} if warned is None else warned
        self._last_read: int | None = None  # the seq of the last line read, in file order
        self._marks: dict[tuple[int, str], None] = {}  # `_RUN_EDGES` lines read (bounded)
        self._caught_up = False
        #: The first bytes of each file met so far (`_settled_head`), newest last: a rescan
        #: stops at one of them as it does at the anchor. The anchor alone is not enough
        #: when it is deleted from among the rotated files (a clean-up, logrotate, a
        #: smaller ``keep``): the rescan walked on into older files, read or passed over
        #: before, and took their ``ready`` records for a new run, printing them again.
        self._known_heads: dict[bytes, None] = {}
        #: How many times the log was found begun anew (a new run, or ``since_seq`` ahead
        #: of everything in it).
        self.new_runs = 0

    def close(self) -> None:
        sources = [*self._pending, self._live, self._anchor]
        self._pending.clear()
        self._live = self._anchor = None
        for src in sources:
            if src is not None:
                src.file.close()

    # -- reading

    def _feed(self, src: _Source, data: bytes, out: list[EventRecord]) -> None:
        for raw in src.framer.feed(data):
            decoded = _decode(raw)  # None for TOO_LONG, as for any line that is no event
            if decoded is None:
                continue
            event, text = decoded
            if not self._fresh(event):
                continue
            if self._types is not None and event["type"] not in self._types:
                continue
            out.append(EventRecord(event, text))

    def _fresh(self, event: dict[str, Any]) -> bool:
        """The duplicate guard (`Handover`), aware of new runs: a ``ready`` or ``stopped``
        whose seq is not above the last one read, and that is no line read before, opens a
        run that numbered from 1 again (every log file deleted, the watcher restarted). Its
        events are new: without this a follower printed nothing until they passed the old
        run's seqs."""
        seq: int = event["seq"]
        if self._runs and event["type"] in _RUN_EDGES:
            mark = (seq, str(event.get("time")))
            if mark not in self._marks:
                if self._last_read is not None and seq <= self._last_read:
                    self._handover.last_seq = min(self._handover.last_seq, seq - 1)
                    self.new_runs += 1
                    _log.info("event log %s: a new run of the watcher begins at seq %d",
                              self._path, seq)
                self._marks[mark] = None
                if len(self._marks) > _RUN_MARKS:
                    del self._marks[next(iter(self._marks))]
        self._last_read = seq
        if self._runs:
            self._note_hole(event)
        return self._handover.fresh(seq)

    def _note_hole(self, event: dict[str, Any]) -> None:
        """Say which seqs a follower passes over: a file rotated out or deleted before it
        was read, a damaged line. Was: a silent jump in the seqs printed. A ``log-gap``
        record names its own hole and is printed, so only what it does not cover is said."""
        seq: int = event["seq"]
        after = self._handover.last_seq
        if math.isinf(after) or seq <= after + 1:
            return
        first = gap_span(event)
        end = seq - 1 if first is None else first - 1
        if end > after:
            _log.info("event log %s: seqs %d-%d are not in the log (rotated out or deleted "
                      "before they were read, or damaged): passed over", self._path,
                      int(after) + 1, end)

    def _finish(self, src: _Source) -> None:
        """A pending file read to its end: any torn tail is permanent, drop it."""
        src.framer.reset()
        src.carry = b""
        src.consumed = True
        if src is not self._anchor:
            src.file.close()

    def caught_up(self) -> None:
        """The follower has read all the log holds (its first wait for more). A
        ``since_seq`` ahead of every seq read (or none read: no log yet) came from an
        earlier run of a log begun anew since (its files deleted; a log on tmpfs after a
        reboot): what is appended from now on is new, whatever its seq (as a socket
        subscriber with a ``since_seq`` ahead of the daemon gets the live events)."""
        if self._caught_up:
            return
        self._caught_up = True
        since = self._since_seq
        if (self._runs and since is not None and self._handover.last_seq == since
                and (self._last_read is None or self._last_read < since)):
            self._handover.last_seq = -math.inf if self._last_read is None else self._last_read
            self.new_runs += 1
            _log.info("event log %s: its newest seq (%s) is below %d: the log was begun "
                      "anew since; following what is added to it", self._path,
                      "none" if self._last_read is None else self._last_read, since)

    def poll(self, *, follow: bool = True) -> tuple[list[EventRecord], bool]:
        """(events that became complete, whether anything moved).

        An empty batch with ``True`` means "call again now" (bytes read were all filtered
        out, or a partial line arrived); ``False`` means nothing is new, so wait.
        ``follow=False`` reads what the first scan found and never looks again.
        """
        out: list[EventRecord] = []
        budget = _POLL_BUDGET
        progressed = False
        scanned_once = self._anchor is not None
        while True:
            while self._pending and budget > 0:
                src = self._pending[0]
                data = src.file.read(min(_CHUNK, budget))
                progressed = True
                if data:
                    budget -= len(data)
                    self._feed(src, data, out)
                else:
                    self._pending.popleft()
                    self._finish(src)
            if budget <= 0:
                return out, True
            if self._live is not None:
                data = self._live.file.read(min(_CHUNK, budget))
                if data:
                    budget -= len(data)
                    progressed = True
                    if follow and self._live.rewritten():
                        # Emptied in place and written past where we were: what was read is
                        # the middle of the new content. Read it from its start instead.
                        self._live.restart()
                        continue
                    self._feed(self._live, data, out)
                    continue
            if out or (not follow and scanned_once):
                return out, progressed
            scanned_once = True
            if not self._refresh():
                return out, progressed
            progressed = True

    def read_chunk(self, wants: Callable[[str, Any], bool] | None = None) -> RawChunk | None:
        """One read (at most ``_REPLAY_CHUNK`` bytes) of the files the first scan found, as a
        `RawChunk`; None at their end, `_PROGRESS` (``first`` 0) when the read completed
        no line. For a replay that must not hold the loop: each call is one bounded slice
        of work, and the lines go out as stored.

        A run of whole lines whose seqs follow one another, each line one the writer writes
        and whose bytes prove it strict JSON (`_plain_heads`), is passed on as it is:
        checked in a few passes in C, never split or decoded. Anything else (a damaged
        line, an escape, a byte that is not ASCII), and every line when ``wants(type,
        addr)`` filters, is decoded line by line as `read_records` does: no line goes out
        that `_decode` refuses (but for a key twice over: see `_plain_line_pattern`).

        A chunk never spans a hole: where the seqs jump (a line damaged or lost, a file
        missing) the chunk ends, and the next one starts after the jump, so the caller sees
        a hole inside a file as it sees one between files."""
        if not self._scanned:
            self._scanned = True
            self._refresh()
        while self._after_jump:
            lines, self._after_jump = self._after_jump, []
            chunk = self._decoded(lines, wants)
            if chunk is not None:
                return chunk
        while True:
            if self._pending:
                src = self._pending[0]
                data = src.file.read(_REPLAY_CHUNK)
                if not data:
                    self._pending.popleft()
                    self._finish(src)
                    continue
            elif self._live is not None:
                src = self._live
                data = src.file.read(_REPLAY_CHUNK)
                if not data:
                    return None
            else:
                return None
            chunk = self._next_chunk(src, data, wants)
            # Nothing whole yet (a long line, a crash's NULs): still one read, one call.
            return chunk if chunk is not None else _PROGRESS

    def _next_chunk(self, src: _Source, data: bytes,
                    wants: Callable[[str, Any], bool] | None) -> RawChunk | None:
        if src.framer.pending or src.framer.skipping:  # inside a long line: the framer's
            was_skipping = src.framer.skipping
            lines = src.framer.feed(data)
            # Once it ended in this read, what follows takes the fast path again. Not
            # before: taking the unfinished line back out of the framer at each read copied
            # all of it again each read (quadratic across a crash's megabytes of NULs).
            if (lines or was_skipping) and not src.framer.skipping:
                tail = src.framer.finish()
                src.carry = tail[0] if tail else b""
            return self._decoded(lines, wants)
        buf = src.carry + data if src.carry else data
        cut = buf.rfind(b"\n") + 1
        if cut == 0:
            if len(buf) > _REPLAY_CHUNK:  # a long line: the framer holds its pieces (linear
                src.carry = b""             # copying) and drops it past MAX_EVENT_LINE
                return self._decoded(src.framer.feed(buf), wants)
            src.carry = buf
            return None
        src.carry = buf[cut:]
        complete = buf[:cut] if cut < len(buf) else buf
        if wants is None:
            heads = _plain_heads(complete)  # one per line: its seq, or b"" (see there)
            if heads is not None and b"" not in heads and _GAP_MARK not in complete:
                first = int(heads[0])
                if (first > self._handover.last_seq
                        and list(map(int, heads)) == list(range(first, first + len(heads)))):
                    self._handover.last_seq = first + len(heads) - 1
                    return RawChunk(first, self._handover.last_seq, complete)
            return self._decoded(complete.split(b"\n")[:-1], None, heads)
        return self._decoded(complete.split(b"\n")[:-1], wants)

    def _decoded(self, lines: list[bytes], wants: Callable[[str, Any], bool] | None,
                 heads: list[bytes] | None = None) -> RawChunk | None:
        """`RawChunk` of the lines that are events after the last seq, up to a jump in
        their seqs: the lines from there on wait in ``_after_jump`` for the next chunk, so
        that no chunk's ``first`` … ``last`` covers a seq it lacks.

        Each line is decoded, but for one whose ``heads`` item (`_plain_heads`, given when
        nothing filters) already names its seq: only the lines it cannot vouch for pay for
        a decode."""
        kept: list[bytes] = []
        start: int | None = None
        last = 0
        for index, raw in enumerate(lines):
            event: dict[str, Any] | None = None
            if heads is not None and heads[index] and _GAP_MARK not in raw:
                seq = int(heads[index])
            else:
                decoded = _decode(raw)
                if decoded is None:
                    continue  # damage: its seq, if it had one, shows as the jump after it
                event = decoded[0]
                seq = event["seq"]
            if seq <= self._handover.last_seq:
                continue  # the duplicate guard of `_feed`
            gap = None if event is None else gap_span(event)
            if start is not None and (seq != last + 1 or gap is not None):
                self._after_jump = lines[index:]
                break
            if gap is not None:  # a hole, not an event: a chunk of its own (`RawChunk.gap`)
                assert event is not None
                self._after_jump = lines[index + 1 :]
                self._handover.last_seq = seq
                wanted = wants is None or wants(event["type"], event.get("addr"))
                return RawChunk(seq, seq, raw + b"\n" if wanted else b"", gap)
            self._handover.last_seq = seq
            last = seq
            start = seq if start is None else start
            if wants is None or (event is not None and wants(event["type"], event.get("addr"))):
                kept.append(raw + b"\n")
        if start is None:
            return None
        return RawChunk(start, last, b"".join(kept))

    # -- rotation

    def _refresh(self) -> bool:
        """Look at the directory; True when there is something new to read."""
        ident = _stat_ident(self._path)
        changed = False
        live = self._live
        if live is not None:
            if ident == live.ident:
                if (os.fstat(live.file.fileno()).st_size < live.file.tell()
                        or live.rewritten()):
                    # Truncated in place (copytruncate, ``: > PATH``), and maybe written
                    # anew as far as we had read or further: start over.
                    live.restart()
                    return True
                return False
            # PATH names another file or none: the writer closed this one before renaming
            # it, so what is on disk now is all it will ever hold. Drain it, then move on.
            self._pending.append(live)
            self._live = None
            changed = True
        try:
            new_live, rotated = self._scan()
        except OSError:
            if changed:
                return True  # what the old file still holds first: the next look raises
            raise
        if not rotated and new_live is None:
            return changed
        self._pending.extend(reversed(rotated))
        if new_live is not None:
            self._live = new_live
        old_anchor = self._anchor
        self._anchor = new_live if new_live is not None else rotated[0]
        if old_anchor is not None and old_anchor.consumed:
            old_anchor.file.close()
        if (old_anchor is None and self._since_seq is not None
                and self._handover.last_seq == self._since_seq):
            # Not once `caught_up` took ``since_seq`` for an earlier run's (no log yet when
            # the follower started): all the log holds was added since, and is printed
            # (was: a bisection to ``since_seq`` passed over what the new log held by then).
            self._skip_to(self._since_seq)
        return True

    def _skip_to(self, since_seq: int) -> None:
        """Start a replay at ``since_seq`` without reading what precedes it.

        Seqs grow down the log, so a file can be passed over whole when a later one holds
        an event at or before ``since_seq + 1``: the newest such file is where to start
        (`_start_file`), and it is entered by bisection. Each file is looked at in bounded
        windows (`_event_after`, `_event_before`), never read through: a replay from near
        the end of a 384 MiB log, or of files that end in megabytes of a crash's junk,
        costs a few reads a file.
        """
        sources = [*self._pending] + ([] if self._live is None else [self._live])
        for _ in range(_start_file(sources, since_seq)):
            self._finish(self._pending.popleft())
        first = self._pending[0] if self._pending else self._live
        if first is not None:
            first.file.seek(_offset_after_seq(first.file, since_seq))
            first.framer.reset()
            first.carry = b""

    def _scan(self) -> tuple[_Source | None, list[_Source]]:
        """Open files newer than the anchor: (PATH's file or None, rotated ones newest first).

        Opening newest-first while renames move files to higher numbers can meet a file
        twice (deduplicated by inode) but never skip one, as long as no rotation completes
        during the scan; PATH and PATH.1 both change identity when one does, so compare them
        before and after and scan again.
        """
        for attempt in range(_SCAN_ATTEMPTS):
            before = (_stat_ident(self._path), _stat_ident(rotated_path(self._path, 1)))
            live, rotated = self._scan_once()
            after = (_stat_ident(self._path), _stat_ident(rotated_path(self._path, 1)))
            if before == after or attempt == _SCAN_ATTEMPTS - 1:
                for src in [*rotated, *([] if live is None else [live])]:
                    self._remember_head(src)
                return live, rotated
            _close_sources(live, rotated)
        raise AssertionError("unreachable")  # pragma: no cover

    def _remember_head(self, src: _Source) -> None:
        try:
            head = _settled_head(src.file)
        except OSError:
            return  # not known by its head, then: read on as before
        if head:
            self._known_heads[head] = None
            if len(self._known_heads) > _KNOWN_HEADS:
                del self._known_heads[next(iter(self._known_heads))]

    def _scan_once(self) -> tuple[_Source | None, list[_Source]]:
        anchor = None if self._anchor is None else self._anchor.ident
        seen: set[_Ident] = set()
        live: _Source | None = None
        rotated: list[_Source] = []
        index, misses = 0, 0
        while misses < _MAX_GAP:
            name = rotated_path(self._path, index)
            index += 1
            try:
                opened = _open_log_file(name)  # closed by the follower
            except _NotALogFile as exc:
                if index > 1:  # PATH.N: the writer never rotates into it; read around it
                    _warn_skipped(self._warned, name,
                                  not_a_log_file(name) or f"{name}: {exc.strerror}", exc.st)
                    misses = 0
                    continue
                _close_sources(live, rotated)  # not the follower's yet: close them here
                raise
            except OSError as exc:
                if index > 1 and exc.errno in (errno.ELOOP, errno.EACCES, errno.EPERM):
                    # A link that leads nowhere, or a rotated file we may not read: a hole
                    # in the log, read around like what is no log file (PATH itself is not).
                    why = (f"{name} is a link that loops, not an event log file"
                           if exc.errno == errno.ELOOP
                           else f"{name} cannot be read: {_describe_os_error(exc)}")
                    with contextlib.suppress(OSError):
                        _warn_skipped(self._warned, name, why, os.lstat(name))
                    misses = 0
                    continue
                _close_sources(live, rotated)  # not the follower's yet: close them here
                raise
            if opened is None:
                misses += 1
                continue
            misses = 0
            f, st = opened
            ident = (st.st_dev, st.st_ino)
            if ident == anchor:
                f.close()
                break
            if ident in seen:
                f.close()
                continue
            try:
                met = index > 1 and _settled_head(f) in self._known_heads
            except OSError:
                f.close()
                _close_sources(live, rotated)  # not the follower's yet: close them here
                raise
            if met:
                f.close()  # a file met before: it and all older ones were read or passed
                break
            seen.add(ident)
            src = _Source(f, ident)
            if index == 1:
                live = src
            else:
                rotated.append(src)
        return live, rotated


def read_records(
    path: str | os.PathLike[str],
    *,
    since_seq: int | None = None,
    types: Collection[str] | None = None,
) -> Generator[EventRecord, None, None]:
    """Like :func:`read_events`, with each event's stored line alongside (close it to
    release the files before its end)."""
    follower = _Follower(path, since_seq, types)
    try:
        while True:
            batch, more = follower.poll(follow=False)
            yield from batch
            if not more:
                return
    finally:
        follower.close()


def read_chunks(
    path: str | os.PathLike[str],
    *,
    since_seq: int | None = None,
    wants: Callable[[str, Any], bool] | None = None,
    progress: bool = False,
) -> Iterator[RawChunk]:
    """The log after ``since_seq`` as `RawChunk` runs of stored lines (a replay to a socket):
    with ``progress``, each ``next`` is one read of at most 4 KiB, so a caller on an event
    loop can yield between chunks (a read that completed no line, inside a long line or a
    crash's NULs, gives a chunk with ``first`` 0 and no data, which holds no seq; the first
    ``next`` also finds where ``since_seq`` is, a few reads that a caller on an event loop
    runs in a thread). Without it such chunks are left out. ``wants(type, addr)`` keeps
    only the lines it accepts; the seq range of each chunk still covers what was read.
    Where the log lacks a seq (a line damaged or lost, a file missing) one chunk ends and
    the next starts after it: a caller finds every hole as a jump between two chunks (or
    as a ``log-gap`` record's chunk, `RawChunk.gap`). Close the iterator to release the
    files."""
    follower = _Follower(path, since_seq, None, warned=_replay_warned)
    try:
        while (chunk := follower.read_chunk(wants)) is not None:
            if chunk.first or progress:
                yield chunk
    finally:
        follower.close()


def read_events(
    path: str | os.PathLike[str],
    *,
    since_seq: int | None = None,
    types: Collection[str] | None = None,
) -> Iterator[dict[str, Any]]:
    """All complete events in PATH.K … PATH.1, PATH, oldest first, ``seq > since_seq``,
    ``type in types``. A torn last line and malformed lines are skipped; no log, no events.
    """
    for record in read_records(path, since_seq=since_seq, types=types):
        yield record.event


def follow_records(
    path: str | os.PathLike[str],
    *,
    since_seq: int | None = None,
    types: Collection[str] | None = None,
    poll_interval: float = 0.1,
    stop: Callable[[], bool] | None = None,
) -> Iterator[EventRecord]:
    """Like :func:`follow_events`, with each event's stored line alongside."""
    follower = _Follower(path, since_seq, types, runs=True)
    try:
        while stop is None or not stop():
            batch, more = follower.poll()
            yield from batch
            if not more:
                follower.caught_up()
                time.sleep(poll_interval)
    finally:
        follower.close()


def follow_events(
    path: str | os.PathLike[str],
    *,
    since_seq: int | None = None,
    types: Collection[str] | None = None,
    poll_interval: float = 0.1,
    stop: Callable[[], bool] | None = None,
) -> Iterator[dict[str, Any]]:
    """:func:`read_events`, then every event appended later, across rotations, until stop().

    Waits for PATH to appear if it does not exist. A line is yielded once its newline is on
    disk, each seq at most once. Events are lost only if the log rotates them out (``keep``
    files) before the follower reads them.
    """
    for record in follow_records(
        path, since_seq=since_seq, types=types, poll_interval=poll_interval, stop=stop
    ):
        yield record.event


async def afollow_records(
    path: str | os.PathLike[str],
    *,
    since_seq: int | None = None,
    types: Collection[str] | None = None,
    poll_interval: float = 0.1,
    stop: Callable[[], bool] | None = None,
) -> AsyncGenerator[EventRecord, None]:
    """Async :func:`follow_records`. Reads run inline: local-file reads are short and
    bounded per poll, cheaper than a thread hop per batch."""
    follower = _Follower(path, since_seq, types, runs=True)
    try:
        while stop is None or not stop():
            batch, more = follower.poll()
            for record in batch:
                yield record
            if more:
                await end_turn()  # a long backlog of records: let requests in between
            else:
                follower.caught_up()
                await anyio.sleep(poll_interval)
    finally:
        follower.close()


async def afollow_events(
    path: str | os.PathLike[str],
    *,
    since_seq: int | None = None,
    types: Collection[str] | None = None,
    poll_interval: float = 0.1,
    stop: Callable[[], bool] | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """Async :func:`follow_events` (for the socket service); cancel it or use ``stop``.

    Closed early (``contextlib.aclosing`` after a ``break``), it closes the follower it
    wraps then, with its files: left to the collector, that one would keep the log open
    meanwhile, and trio warns of every async generator it finalises."""
    async with contextlib.aclosing(afollow_records(
        path, since_seq=since_seq, types=types, poll_interval=poll_interval, stop=stop
    )) as records:
        async for record in records:
            yield record.event
