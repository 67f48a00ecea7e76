"""Recorded uevents from a JSONL file or FIFO: one JSON object of uevent properties a line.

This is what ``gpuwatch record`` writes, so a recording replays through the same model
as live events. It reads big chunks and yields each chunk's complete lines as one batch,
which keeps replay fast (well above 50k events/s). A bad line is skipped and logged (the
first ten one by one, then at most one a second, and the total at the end):
one corrupt record must not throw away the rest of a recording.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
from collections.abc import AsyncIterator, Callable
from types import MappingProxyType
from typing import Any

import anyio

from gpuwatch.core.ndjson import TOO_LONG, LineFramer
from gpuwatch.core.uevent import UEvent
from gpuwatch.errors import CallerError
from gpuwatch.lograte import RateLimitedLog
from gpuwatch.sources import SourceOverflow, SourceReadError, SourceUnavailable
from gpuwatch.sources.turns import end_turn

__all__ = ["JsonlFileSource", "parse_jsonl_line", "uevent_to_json"]

log = logging.getLogger("gpuwatch.sources")

CHUNK_SIZE = 1 << 20
#: A "line" longer than this is garbage (a binary file, a missing newline): drop it.
MAX_LINE = 16 << 20
#: Malformed lines named one by one before the rest are held back to one a second.
SKIPS_SHOWN = 10


def uevent_to_json(ev: UEvent) -> str:
    """One line, no newline: sorted keys and no spaces, so recordings diff cleanly."""
    return json.dumps(ev.to_properties(), separators=(",", ":"), sort_keys=True)


class MalformedLine(CallerError, ValueError):
    """A JSONL line that is not an object of string (or number) values."""


_DECODE = json.JSONDecoder().decode


def parse_jsonl_line(raw: bytes | str) -> UEvent:
    """Parse one line; numbers become strings (hand-written files say ``"SEQNUM": 7``).

    Raises :class:`MalformedLine` for bad JSON, a non-object, or non-scalar values. A
    byte-order mark before the line (a recording saved by an editor that adds one, or
    such files concatenated) is no part of it: JSON allows a parser to ignore it.
    """
    if isinstance(raw, bytes) and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    elif isinstance(raw, str) and raw.startswith("\ufeff"):
        raw = raw[1:]
    try:
        # One shared decoder on text: json.loads would sniff the encoding of every line.
        obj: Any = _DECODE(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError; deep
        raise MalformedLine(f"not JSON: {exc}") from exc
    if type(obj) is not dict:
        raise MalformedLine(f"not a JSON object but {type(obj).__name__}")
    for key, value in obj.items():
        if type(value) is str:
            continue
        if type(value) in (int, float):  # bool is not a number here
            obj[key] = str(value)
        else:
            raise MalformedLine(f"value of {key!r} is {type(value).__name__}, not a string")
    # Equivalent to UEvent.from_properties (keys and values are str by now), minus its
    # copy: replay speed is dominated by per-event overhead.
    props: dict[str, str] = obj
    return UEvent(
        action=props.get("ACTION", ""),
        devpath=props.get("DEVPATH", ""),
        subsystem=props.get("SUBSYSTEM", ""),
        properties=MappingProxyType(props),
    )


class _LineSplitter:
    """Turns chunks into events through the shared framer (which keeps the incomplete
    last line for the next chunk and drops an over-long one without holding it)."""

    def __init__(self, origin: str) -> None:
        from pydantic_core import from_json  # here: `gpuwatch record` and the CLI need none

        self._from_json: Callable[[bytes], Any] = from_json
        self._origin = origin
        self._framer = LineFramer(MAX_LINE)
        self.lineno = 0
        self.skipped = 0
        #: A file of garbage is a line per line: bounded, and the total comes at the end.
        self._warnings = RateLimitedLog(log, burst=SKIPS_SHOWN, per_second=1.0,
                                        subject="about malformed uevent lines")

    def feed(self, chunk: bytes) -> list[UEvent]:
        return self._parse(self._framer.feed(chunk))

    def finish(self) -> list[UEvent]:
        """At EOF: a last line without a newline still counts."""
        return self._parse(self._framer.finish())

    def _parse(self, lines: list[bytes]) -> list[UEvent]:
        events: list[UEvent] = []
        append = events.append
        parse, new, proxy = self._from_json, tuple.__new__, MappingProxyType
        for raw in lines:
            self.lineno += 1
            # The common line, an object of strings, straight through pydantic-core's parser
            # (on bytes, twice the json module's speed); anything it refuses or any other shape
            # (numbers, a lone surrogate escape, garbage) through parse_jsonl_line, whose
            # verdict is the one that counts.
            try:
                obj = parse(raw)
            except ValueError:
                obj = None
            if type(obj) is dict:
                for value in obj.values():
                    if type(value) is not str:
                        break
                else:
                    get = obj.get
                    # UEvent(...) without the NamedTuple's Python-level __new__.
                    append(new(UEvent, (get("ACTION", ""), get("DEVPATH", ""),
                                        get("SUBSYSTEM", ""), proxy(obj))))
                    continue
            try:
                append(parse_jsonl_line(raw))
            except MalformedLine as exc:
                if raw is TOO_LONG:
                    self._skip(self.lineno, f"line longer than {MAX_LINE} bytes")
                elif raw.strip():  # blank lines are just spacing
                    self._skip(self.lineno, str(exc))
        return events

    def _skip(self, lineno: int, why: str) -> None:
        self.skipped += 1
        self._warnings.warning("%s:%d: malformed uevent line skipped: %s", self._origin,
                               lineno, why)


class JsonlFileSource:
    """Events replayed from ``path`` (a regular file or a FIFO); ends at EOF.

    A FIFO is opened non-blocking, so ``start`` never waits for a writer; readiness
    (data, or the first writer hanging up) is then awaited on the event loop.
    """

    def __init__(self, path: str | os.PathLike[str], *, chunk_size: int = CHUNK_SIZE) -> None:
        self.name: str = "file"
        self.path = os.fspath(path)
        self.warnings: list[str] = []
        self._chunk_size = chunk_size
        self._fd = -1
        self._pollable = False
        self._closed = False

    def start(self) -> None:
        """Open the file now; for a FIFO this also lets a blocked writer proceed."""
        if self._closed:
            raise SourceUnavailable(f"event file {self.path!r}: source was closed")
        if self._fd >= 0:
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise SourceUnavailable(
                f"cannot open event file {self.path!r}: {exc.strerror}"
            ) from exc
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            os.close(fd)
            raise SourceUnavailable(f"event file {self.path!r} is a directory")
        # Regular files are always "ready" and epoll refuses them: just read them.
        self._pollable = not (stat.S_ISREG(mode) or stat.S_ISBLK(mode))
        if not self._pollable:
            os.set_blocking(fd, True)
        self._fd = fd

    async def batches(self) -> AsyncIterator[list[UEvent] | SourceOverflow]:
        """Yield the events of each chunk read, until EOF (or ``close``)."""
        self.start()
        splitter = _LineSplitter(self.path)
        # Once a writer has sent data, a read is tried before waiting: in a storm the next
        # chunk is usually there already, and a wait costs a poller round of its own. (Not
        # before: a FIFO that no writer has opened yet reads as EOF.)
        flowing = False
        while self._fd >= 0:
            if self._pollable and flowing:
                await end_turn()  # let other tasks and requests in between chunks
                if self._fd < 0:
                    return
                try:
                    chunk = self._read()
                except BlockingIOError:
                    flowing = False
                    continue
            elif self._pollable:
                try:
                    await anyio.wait_readable(self._fd)
                except anyio.ClosedResourceError:
                    return
                except PermissionError:
                    # epoll refuses some character devices (``/dev/null``): they never
                    # block, so read them like a regular file.
                    self._pollable = False
                    os.set_blocking(self._fd, True)
                    continue
                if self._fd < 0:
                    return
                try:
                    chunk = self._read()
                except BlockingIOError:
                    continue
                flowing = bool(chunk)
            else:
                await end_turn()  # let other tasks and requests in between chunks
                if self._fd < 0:
                    return
                chunk = self._read()
            if not chunk:
                last = splitter.finish()
                if last:
                    yield last
                if splitter.skipped:
                    log.warning("%s: %d malformed line(s) skipped", self.path, splitter.skipped)
                return
            batch = splitter.feed(chunk)
            if batch:
                yield batch

    def _read(self) -> bytes:
        """The next chunk; ``b""`` at EOF. A read that fails (EIO) is a `SourceReadError`
        naming the file: it is no write error of a recording nor an internal error.
        BlockingIOError (a FIFO with nothing to read yet) is the caller's to handle."""
        try:
            return os.read(self._fd, self._chunk_size)
        except BlockingIOError:
            raise
        except OSError as exc:
            raise SourceReadError(
                f"cannot read event file {self.path!r}: {exc.strerror or exc}") from exc

    def close(self) -> None:
        """Close the file; a ``batches`` waiting on a FIFO ends (idempotent)."""
        self._closed = True
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        if self._pollable:
            with contextlib.suppress(RuntimeError):  # no loop running: nobody waits
                anyio.notify_closing(fd)
        os.close(fd)
