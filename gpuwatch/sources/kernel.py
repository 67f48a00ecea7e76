"""The kernel's own uevents from a raw ``NETLINK_KOBJECT_UEVENT`` socket: stdlib only.

The default source. It needs no udevd (containers and minimal hosts have none) and no
libudev: a message is parsed straight from its bytes into a `UEvent`, about a tenth of what
the pyudev receive path costs per event. Read on the event loop like every source: wait
until readable, then drain up to `MAX_BATCH` messages as one batch. Lost events (ENOBUFS)
are drained to EAGAIN and reported as one `SourceOverflow`, so the watcher rescans once;
the few drained uevents that carry facts a rescan cannot see follow it as a batch.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import anyio

from gpuwatch.core.limits import MAX_RECEIVE_BUFFER, MIN_RECEIVE_BUFFER
from gpuwatch.core.uevent import UEvent, parse_kernel_uevent, subsystem_of
from gpuwatch.errors import UsageError
from gpuwatch.sources import SourceOverflow, SourceUnavailable, drain_after_loss
from gpuwatch.sources.turns import end_turn

__all__ = [
    "DEFAULT_RECEIVE_BUFFER",
    "KERNEL_GROUP",
    "MAX_BATCH",
    "MAX_READ",
    "SUBSYSTEMS",
    "KernelSource",
    "describe_errno",
    "receive_buffer_size",
    "report_buffer",
    "set_receive_buffer",
    "user_namespace_warning",
]

log = logging.getLogger("gpuwatch.sources")

#: Subsystems whose uevents can change the GPU host model.
SUBSYSTEMS = frozenset({"pci", "drm", "graphics", "vfio", "vfio-dev", "module", "kfd"})

#: Big enough to absorb a full driver rebind storm while the loop is busy.
DEFAULT_RECEIVE_BUFFER = 128 * 1024 * 1024

#: One batch at most: small enough that the loop serves socket requests between batches
#: within a few milliseconds, big enough that a storm costs few wake-ups.
MAX_BATCH = 256

#: Messages one drain reads at most, kept or not: a flood of uevents of subsystems not
#: followed (or of forgeries) must not hold the event loop until it stops.
MAX_READ = 4 * MAX_BATCH

#: ``NETLINK_KOBJECT_UEVENT`` (Python's socket module lacks the name) and its kernel group.
NETLINK_KOBJECT_UEVENT = 15
KERNEL_GROUP = 1
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
#: The kernel caps one uevent at 2 KiB of properties (UEVENT_BUFFER_SIZE) plus the header.
_MAX_MESSAGE = 8192

#: The largest value of a C int: the kernel holds a receive buffer request to half of it.
_INT_MAX = 2**31 - 1

_INITIAL_UID_MAP = ["0", "0", "4294967295"]
UID_MAP_PATH = "/proc/self/uid_map"
_RMEM_MAX_PATH = "/proc/sys/net/core/rmem_max"


def user_namespace_warning(uid_map: str) -> str | None:
    """A warning when ``uid_map`` is not the initial user namespace's identity map.

    The kernel broadcasts uevents only to sockets of the initial user namespace, so in
    a container the kernel source stays silent and nothing else would say why.
    """
    rows = [line.split() for line in uid_map.splitlines() if line.strip()]
    if rows == [_INITIAL_UID_MAP]:
        return None
    return (
        "running in a non-initial user namespace (/proc/self/uid_map is not "
        "'0 0 4294967295'): the kernel uevent source is silent here, so changes to the "
        "host will not be seen"
    )


def namespace_warnings(uid_map_path: str) -> list[str]:
    try:
        with open(uid_map_path, encoding="ascii") as f:
            warning = user_namespace_warning(f.read())
    except (OSError, ValueError):
        warning = None  # no /proc: nothing to say
    return [] if warning is None else [warning]


def describe_errno(code: int) -> str:
    """``ENOBUFS: No buffer space available`` — the symbolic name is what people grep for."""
    return f"{errno.errorcode.get(code, f'errno {code}')}: {os.strerror(code)}"


def _rmem_max() -> int | None:
    try:
        with open(_RMEM_MAX_PATH, encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _force(sock: socket.socket) -> Callable[[int], None]:
    def force(size: int) -> None:
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, size)

    return force


def receive_buffer_size(size: int | None) -> int:
    """The size to ask for: the default, or ``size`` where a socket can take it."""
    if size is None:
        return DEFAULT_RECEIVE_BUFFER
    if type(size) is not int or not MIN_RECEIVE_BUFFER <= size <= MAX_RECEIVE_BUFFER:
        raise UsageError(f"receive_buffer must be an integer from "
                                   f"{MIN_RECEIVE_BUFFER} to {MAX_RECEIVE_BUFFER}, not {size!r}")
    return size


def _full_grant(asked: int) -> int:
    """What ``SO_RCVBUF`` reads back for a request granted in full: twice the size asked
    (the kernel doubles it, half being its bookkeeping), the request first held to
    ``INT_MAX / 2``. A request capped at ``net.core.rmem_max`` reads back less."""
    return 2 * min(asked, _INT_MAX // 2)


def report_buffer(source: str, obtained: int, asked: int) -> None:
    """Say the receive buffer obtained: a warning where the kernel capped it (no
    CAP_NET_ADMIN: ``net.core.rmem_max``, 208 KiB by default), as a storm then overflows it.

    ``obtained`` is what ``SO_RCVBUF`` reads back, twice the usable size: a request of
    6 MiB capped at a 4 MiB ``rmem_max`` reads back 8 MiB, more than was asked, and is
    still capped, so it is compared with `_full_grant`, and the usable half is what is said."""
    if obtained < _full_grant(asked):
        log.warning("%s uevent source: receive buffer capped at %d bytes, not the %d asked "
                    "for (without CAP_NET_ADMIN the kernel allows net.core.rmem_max): a uevent "
                    "storm may overflow it, and each overflow costs a rescan", source,
                    obtained // 2, asked)
    else:
        log.info("%s uevent source: receive buffer %d bytes (asked for %d)", source,
                 obtained // 2, asked)


def set_receive_buffer(
    sock: socket.socket, size: int, force: Callable[[int], None] | None = None
) -> int:
    """Ask for a ``size``-byte receive buffer; return the size the kernel actually set.

    Like udevd, try SO_RCVBUFFORCE first (``force``; it needs CAP_NET_ADMIN). Without it
    fall back to SO_RCVBUF, which the kernel silently caps at ``net.core.rmem_max`` — so
    the value is read back rather than assumed (the kernel also doubles it).
    """
    try:
        (force or _force(sock))(size)
    except (OSError, ValueError, OverflowError) as exc:
        log.debug("SO_RCVBUFFORCE(%d) refused (%s); falling back to SO_RCVBUF", size, exc)
        before = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        cap = _rmem_max()
        # Growing past rmem_max is impossible here; do not shrink a bigger buffer trying.
        shrinks_instead = size * 2 > before and cap is not None and 2 * min(size, cap) < before
        if not shrinks_instead:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
            except (OSError, OverflowError) as exc2:
                log.warning("cannot set the uevent receive buffer to %d: %s", size, exc2)
    obtained: int = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    return obtained


class KernelSource:
    """uevents straight from the kernel's netlink multicast group (``--source kernel``)."""

    name = "kernel"

    def __init__(
        self,
        *,
        receive_buffer: int | None = None,
        subsystems: Iterable[str] = SUBSYSTEMS,
        uid_map_path: str = UID_MAP_PATH,
        keep_queued: bool = False,
    ) -> None:
        self.receive_buffer = receive_buffer_size(receive_buffer)
        self.subsystems = frozenset(subsystems)
        #: After a loss, deliver what the kernel still queued instead of discarding it (see
        #: `gpuwatch.sources.drain_lost`): for a recording, which has no rescan to cover it.
        self.keep_queued = keep_queued
        self._wanted = frozenset(s.encode() for s in self.subsystems)
        #: Receive buffer size the kernel granted (0 until started).
        self.obtained_buffer = 0
        #: Messages dropped for not coming from the kernel (another process's forgery).
        self.rejected = 0
        self.warnings: list[str] = namespace_warnings(uid_map_path)
        self._sock: socket.socket | None = None
        self._fd = -1
        self._closed = False

    def start(self) -> None:
        """Bind the socket now: events from this moment on are queued for ``batches``."""
        if self._closed:
            raise SourceUnavailable("kernel uevent source was closed")
        if self._sock is not None:
            return
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_KOBJECT_UEVENT)
        except (OSError, AttributeError) as exc:
            raise SourceUnavailable(f"cannot open the kernel uevent netlink socket: {exc}") from exc
        try:
            self.obtained_buffer = set_receive_buffer(sock, self.receive_buffer)
            sock.bind((0, KERNEL_GROUP))
            sock.setblocking(False)
        except (OSError, OverflowError) as exc:
            sock.close()
            raise SourceUnavailable(f"cannot bind the kernel uevent netlink socket: {exc}") from exc
        report_buffer(self.name, self.obtained_buffer, self.receive_buffer)
        self._sock, self._fd = sock, sock.fileno()

    async def batches(self) -> AsyncIterator[list[UEvent] | SourceOverflow]:
        """Yield every drained batch (and one overflow marker whenever events were lost).

        Holds no local reference to the socket across a ``yield``, so ``close`` really
        closes it even while this generator is suspended.
        """
        self.start()
        failures = 0
        while self._sock is not None:
            try:
                await anyio.wait_readable(self._fd)
            except (anyio.ClosedResourceError, OSError, ValueError):
                return
            while self._sock is not None:
                batch, overflow, more = self._drain()
                if batch:
                    yield batch
                if overflow is not None:
                    kept: list[UEvent] = []
                    if overflow.error.startswith("ENOBUFS") and not self.keep_queued:
                        # Discard what is queued (the rescan covers it), a slice a turn, but
                        # for what only a uevent says: it follows the marker, in order.
                        dropped, facts = await drain_after_loss(
                            lambda: self._sock, _MAX_MESSAGE, self._trusted)
                        kept = facts.events()
                        overflow = SourceOverflow(overflow.error, dropped, facts.unkept)
                        log.debug("kernel uevent source lost events (%s; %d queued dropped, "
                                  "%d kept)", overflow.error, dropped, len(kept))
                    yield overflow
                    if kept:
                        yield kept
                    if overflow.error.startswith("ENOBUFS"):
                        failures = 0
                    else:  # an error we did not expect: back off instead of spinning on it
                        failures += 1
                        await anyio.sleep(min(0.01 * 2**failures, 1.0))
                        break
                if not more:
                    break
                # Let requests and other tasks in between batches of a backlog.
                await end_turn()

    def _drain(self) -> tuple[list[UEvent], SourceOverflow | None, bool]:
        """Receive until empty, `MAX_BATCH` events, `MAX_READ` messages, or an error.

        Returns ``(batch, overflow, more)``; ``more`` when the queue may hold more.
        """
        batch: list[UEvent] = []
        sock = self._sock
        if sock is None:
            return batch, None, False
        wanted = self._wanted
        recvfrom = sock.recvfrom
        for _ in range(MAX_READ):
            if len(batch) >= MAX_BATCH:
                break
            try:
                data, sender = recvfrom(_MAX_MESSAGE)
            except BlockingIOError:
                return batch, None, False
            except InterruptedError:
                continue
            except OSError as exc:
                return batch, self._lost(exc), True
            if sender[0] != 0:  # only the kernel (port 0) speaks here; anything else is forged
                self.rejected += 1
                continue
            if subsystem_of(data) not in wanted:
                continue
            event = parse_kernel_uevent(data)
            if event is not None:
                batch.append(event)
        return batch, None, True

    def _trusted(self, data: bytes, address: Any,
                 _ancdata: list[tuple[int, int, bytes]]) -> UEvent | None:
        """A message drained after a loss as `_drain` would take it: from the kernel, of a
        subsystem followed."""
        if address[0] != 0 or subsystem_of(data) not in self._wanted:
            return None
        return parse_kernel_uevent(data)

    @staticmethod
    def _lost(exc: OSError) -> SourceOverflow:
        """Events were lost (``batches`` drains what is queued after an ENOBUFS)."""
        code = exc.errno or 0
        return SourceOverflow(error=describe_errno(code) if code else f"receive failed: {exc}")

    def close(self) -> None:
        """Close the socket; a ``batches`` waiting on it ends (idempotent)."""
        self._closed = True
        sock, self._sock = self._sock, None
        fd, self._fd = self._fd, -1
        if fd >= 0:
            # Without a running event loop nobody can be waiting on the fd.
            with contextlib.suppress(RuntimeError):
                anyio.notify_closing(fd)
        if sock is not None:
            sock.close()
