"""Where uevents come from: the kernel's netlink socket, udevd's, or a recorded JSONL file.

Every source reduces to batches of :class:`~gpuwatch.core.uevent.UEvent`, so the watcher
never knows which one it is reading. Sources are opened through :func:`open_source`; the
concrete modules are imported lazily so that reading a file never loads libudev.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from gpuwatch.core.uevent import UEvent
from gpuwatch.core.uevent_facts import LostFacts, may_carry_facts
from gpuwatch.errors import INVALID_PARAMS, SOURCE_UNAVAILABLE, CallerError, HostError

__all__ = [
    "MAX_DRAIN",
    "UDEV_CONTROL",
    "EventSource",
    "InvalidSourceSpec",
    "Keep",
    "SourceOverflow",
    "SourceReadError",
    "SourceUnavailable",
    "Trusted",
    "drain_after_loss",
    "drain_lost",
    "drain_to_eagain",
    "open_source",
]

#: udevd's control socket, relative to the host root: its presence means udevd runs.
UDEV_CONTROL = "run/udev/control"


class SourceUnavailable(HostError):
    """The requested source cannot deliver events here; the message says why, in one line."""

    code = SOURCE_UNAVAILABLE


class InvalidSourceSpec(CallerError, SourceUnavailable, ValueError):
    """The source spec is not one of ``auto``, ``udev``, ``kernel`` or ``file:PATH``.

    A subclass of :class:`SourceUnavailable` so that a caller reporting "no source" with
    one line and exit code 2 needs only one ``except``.
    """

    code = INVALID_PARAMS


class SourceReadError(HostError, OSError):
    """A source that was open could not be read on (EIO from a failing disk, a stale NFS
    handle): its events stop here. Not a usage error (the same command worked up to
    now), so not a `SourceUnavailable`: the run ends with one line and exit 1. Still an
    OSError, as the read's own error was before it had a message naming the file."""

    code = SOURCE_UNAVAILABLE


@dataclass(frozen=True)
class SourceOverflow:
    """Events were lost (the socket buffer overflowed): the model is stale, rescan.

    ``dropped``: the queued messages the source discarded after the loss (the rescan covers
    them). Those carrying facts a rescan cannot see (`LostFacts`) it keeps instead, and
    yields as a batch right after this marker; ``unkept``: how many of ``dropped`` carried
    such facts, discarded all the same for its bound. The watcher says both in the journal,
    at most so often (`OverflowGate`), so a source does not: in a storm each loss would be a
    line."""

    error: str
    dropped: int = 0
    unkept: int = 0


#: After an overflow, at most this many queued messages are dropped before giving up (a
#: sender faster than we can discard would otherwise keep us here forever).
MAX_DRAIN = 1 << 20


#: ``keep(data, address, ancdata)``: handed each message a drain reads (`drain_to_eagain`).
Keep = Callable[[bytes, Any, list[tuple[int, int, bytes]]], None]
#: ``trusted(data, address, ancdata)``: the message as a uevent when its sender is believed
#: and it is one the source follows, else None (`drain_after_loss`).
Trusted = Callable[[bytes, Any, list[tuple[int, int, bytes]]], UEvent | None]
#: Room for the sender's credentials (``SCM_CREDENTIALS``, a ``struct ucred``).
_CRED_SPACE = socket.CMSG_SPACE(struct.calcsize("=iII"))


def drain_to_eagain(sock: socket.socket, max_message: int = 65536,
                    limit: int = MAX_DRAIN, keep: Keep | None = None) -> int:
    """The overflow contract every netlink source keeps: after ENOBUFS, discard what is
    queued until EAGAIN, because the rescan that follows covers it, and the next uevent
    read is then one sent *after* the rescan began: nothing stale is applied over it and
    the source is never left deaf behind a full queue. Returns how many were read.

    ``keep`` sees each message first (with its sender and credentials), for the few that
    carry what no rescan can see (`drain_after_loss`).
    """
    read = 0
    for _ in range(2 * limit):  # an ENOBUFS between messages costs a try, not a message
        if read >= limit:
            break
        try:
            if keep is None:
                sock.recv(max_message, socket.MSG_DONTWAIT)
            else:
                data, ancdata, _flags, address = sock.recvmsg(max_message, _CRED_SPACE,
                                                              socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            break
        except OSError as exc:
            if exc.errno == errno.ENOBUFS:
                continue  # overflowed again while draining: one rescan covers both
            break
        read += 1
        if keep is not None:
            keep(data, address, ancdata)
    return read


#: Messages one turn of an overflow's drain discards before other tasks run.
DRAIN_SLICE = 4096


async def drain_lost(sock_of: Callable[[], socket.socket | None],
                     max_message: int = 65536, keep: Keep | None = None) -> int:
    """`drain_to_eagain` a slice at a time, ending the turn between slices: a full 128 MiB
    queue holds a million messages, and discarding them in one go kept every request
    waiting ~0.1 s. ``sock_of`` is asked again after each turn (a close ends the drain).
    Returns how many were read."""
    from gpuwatch.sources.turns import end_turn  # here: anyio only where a source runs

    dropped = 0
    while dropped < MAX_DRAIN:
        sock = sock_of()
        if sock is None:
            break
        slice_ = min(DRAIN_SLICE, MAX_DRAIN - dropped)
        taken = drain_to_eagain(sock, max_message, slice_, keep)
        dropped += taken
        if taken < slice_:
            break
        await end_turn()
    return dropped


async def drain_after_loss(sock_of: Callable[[], socket.socket | None], max_message: int,
                           trusted: Trusted) -> tuple[int, LostFacts]:
    """`drain_lost`, keeping the messages that carry facts a rescan cannot see (a PCI error
    recovery's step, a DRM wedge, a real bind or add: `LostFacts`, bounded): the kernel
    queued them before the loss, and discarding them left a failed recovery or a wedge it
    did report unseen (health ``ok``, no event). A message is tested for their bytes first
    (`may_carry_facts`), then ``trusted`` vouches for its sender and parses it. Returns how
    many were discarded, and what was kept, for the source to yield after its overflow."""
    facts = LostFacts()

    def keep(data: bytes, address: Any, ancdata: list[tuple[int, int, bytes]]) -> None:
        if may_carry_facts(data):
            event = trusted(data, address, ancdata)
            if event is not None:
                facts.offer(event, len(data))

    read = await drain_lost(sock_of, max_message, keep)
    return read - len(facts), facts


@runtime_checkable
class EventSource(Protocol):
    """What the watcher reads from. ``start`` binds now, so nothing after it is lost."""

    name: str
    warnings: list[str]

    def start(self) -> None:
        """Open/bind the underlying socket or file now (idempotent)."""
        ...

    def batches(self) -> AsyncIterator[list[UEvent] | SourceOverflow]:
        """Yield each drained batch; end when the source ends (file EOF or close)."""
        ...

    def close(self) -> None:
        """Release the socket/file; a waiting ``batches`` ends (idempotent)."""
        ...


def open_source(
    spec: str,
    root: str | os.PathLike[str],
    *,
    receive_buffer: int | None = None,
    keep_queued: bool = False,
) -> EventSource:
    """Build (but do not start) the source named by ``spec``.

    ``auto`` is ``kernel``: the raw kernel socket needs neither udevd nor libudev and is the
    fastest. ``udev`` is refused unless udevd's control socket exists under ``root``:
    a udev monitor without udevd is silently deaf, which is worse than an error.
    ``keep_queued``: a netlink source delivers what the kernel still queued after a loss
    instead of discarding it (`drain_lost`), for a consumer with no rescan (a recording).
    """
    spec = spec.strip()
    if spec.startswith("file:"):
        path = spec[len("file:") :]
        if not path:
            raise InvalidSourceSpec("source 'file:' needs a path, e.g. file:events.jsonl")
        try:
            os.stat(path)
        except FileNotFoundError:  # a dangling link too
            raise SourceUnavailable(f"event file {path!r} does not exist") from None
        except (OSError, ValueError) as exc:  # EACCES, ELOOP, …: not "does not exist"
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise SourceUnavailable(f"cannot open event file {path!r}: {why}") from None
        from gpuwatch.sources.jsonl import JsonlFileSource

        return JsonlFileSource(path)

    if spec in ("auto", "kernel"):
        from gpuwatch.sources.kernel import KernelSource

        return KernelSource(receive_buffer=receive_buffer, keep_queued=keep_queued)
    if spec != "udev":
        raise InvalidSourceSpec(
            f"unknown source {spec!r}: expected auto, udev, kernel or file:PATH"
        )
    control = Path(root) / UDEV_CONTROL
    try:
        os.stat(control)
    except (FileNotFoundError, NotADirectoryError):
        raise SourceUnavailable(
            f"udev source needs a running udevd, but {control} does not exist "
            "(a udev monitor without udevd receives nothing); use --source kernel"
        ) from None
    except (OSError, ValueError) as exc:  # EACCES, ENAMETOOLONG, …: unknowable, not absent
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SourceUnavailable(
            f"udev source needs a running udevd, but {control} cannot be checked ({why}); "
            "use --source kernel"
        ) from None
    try:
        from gpuwatch.sources.netlink import NetlinkSource
    except ImportError as exc:  # pyudev is imported for this source only
        raise SourceUnavailable(
            f"udev source needs pyudev, which cannot be imported here ({exc}); "
            "use --source kernel"
        ) from None

    return NetlinkSource("udev", receive_buffer=receive_buffer, keep_queued=keep_queued)
