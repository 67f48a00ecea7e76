"""Live uevents through pyudev: udevd's netlink multicast (``--source udev``), no thread.

The only module that touches pyudev. Use it when udev's view matters (properties added by
udev rules, events only after udevd processed them); the default ``kernel`` source
(`gpuwatch.sources.kernel`) reads the kernel's socket directly and needs neither udevd nor
libudev. ``NetlinkSource("kernel")`` remains as the pyudev baseline of the benchmarks.

It reads on the event loop: wait until the fd is readable, then drain everything queued as
one batch, so a burst costs one wake-up.
A receive error never ends the source: lost events are reported as
:class:`~gpuwatch.sources.SourceOverflow` and the watcher rescans.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
from collections.abc import AsyncIterator, Iterable
from typing import Any, Literal

import anyio
import pyudev

from gpuwatch.core.uevent import (
    UEvent,
    parse_kernel_uevent,
    parse_udev_message,
    subsystem_of,
)
from gpuwatch.sources import SourceOverflow, SourceUnavailable, drain_after_loss
from gpuwatch.sources.kernel import (
    DEFAULT_RECEIVE_BUFFER,
    MAX_BATCH,
    SUBSYSTEMS,
    UID_MAP_PATH,
    describe_errno,
    namespace_warnings,
    receive_buffer_size,
    report_buffer,
    user_namespace_warning,
)
from gpuwatch.sources.kernel import set_receive_buffer as _set_receive_buffer
from gpuwatch.sources.turns import end_turn

__all__ = [
    "DEFAULT_RECEIVE_BUFFER",
    "MAX_BATCH",
    "SUBSYSTEMS",
    "NetlinkSource",
    "describe_errno",
    "set_receive_buffer",
    "user_namespace_warning",
]

log = logging.getLogger("gpuwatch.sources")


def set_receive_buffer(monitor: Any, sock: socket.socket, size: int) -> int:
    """`gpuwatch.sources.kernel.set_receive_buffer` through libudev's SO_RCVBUFFORCE."""
    return _set_receive_buffer(sock, size, monitor.set_receive_buffer_size)


_UCRED = struct.Struct("=iII")  # struct ucred: pid, uid, gid


def udevd_sent(address: Any, ancdata: list[tuple[int, int, bytes]]) -> bool:
    """Whether a raw message on a udev monitor's socket is one libudev would believe: sent
    to a multicast group (a unicast's sender is trusted by no pyudev monitor) by root (the
    credentials the kernel attaches, as libudev turns ``SO_PASSCRED`` on)."""
    if not address[1]:
        return False
    for level, kind, data in ancdata:
        if (level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS
                and len(data) >= _UCRED.size):
            return bool(_UCRED.unpack_from(data)[1] == 0)
    return False


def _raw_properties(device: Any) -> dict[str, str]:
    """A device's properties with the bytes that are not UTF-8 kept as surrogate escapes, as
    the kernel source keeps them: a wedge's ``TASK=`` is a process name, any bytes, and
    pyudev's strict decoding would cost the whole uevent (the wedge with it). Read from
    libudev's property list through pyudev's own helper; raises `ValueError` if that
    helper is not there (the caller then skips the uevent, as before)."""
    try:
        from pyudev._util import udev_list_iterate

        libudev = device._libudev
        entry = libudev.udev_device_get_properties_list_entry(device)
        return {
            bytes(name).decode("utf-8", "surrogateescape"):
            bytes(value or b"").decode("utf-8", "surrogateescape")
            for name, value in udev_list_iterate(libudev, entry)
        }
    except (ImportError, AttributeError, TypeError) as exc:
        raise ValueError(f"cannot read the raw properties: {exc}") from exc


class NetlinkSource:
    """uevents from the kernel (``kernel``) or from udevd after its rules ran (``udev``)."""

    def __init__(
        self,
        kind: Literal["udev", "kernel"],
        *,
        receive_buffer: int | None = None,
        subsystems: Iterable[str] = SUBSYSTEMS,
        uid_map_path: str = UID_MAP_PATH,
        keep_queued: bool = False,
    ) -> None:
        if kind not in ("udev", "kernel"):
            raise ValueError(f"netlink source kind must be 'udev' or 'kernel', not {kind!r}")
        self.name: str = kind
        self.receive_buffer = receive_buffer_size(receive_buffer)
        self.subsystems = frozenset(subsystems)
        #: As `KernelSource.keep_queued`: after a loss, deliver what is still queued.
        self.keep_queued = keep_queued
        #: Receive buffer size the kernel granted (0 until started).
        self.obtained_buffer = 0
        self.warnings: list[str] = namespace_warnings(uid_map_path)
        self._monitor: Any = None
        self._sock: socket.socket | None = None
        self._fd = -1
        self._closed = False

    def start(self) -> None:
        """Bind the socket now: events from this moment on are queued for ``batches``."""
        if self._closed:
            raise SourceUnavailable(f"{self.name} uevent source was closed")
        if self._monitor is not None:
            return
        try:
            monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source=self.name)
            # libudev applies these in userspace for the kernel source (its BPF filter only
            # understands udevd's messages); we check again in Python either way.
            for subsystem in sorted(self.subsystems):
                monitor.filter_by(subsystem)
            fd: int = monitor.fileno()
            sock = socket.socket(fileno=os.dup(fd))
        except (ImportError, OSError, ValueError) as exc:
            raise SourceUnavailable(
                f"cannot open the {self.name} uevent netlink socket: {exc}"
            ) from exc
        try:
            self.obtained_buffer = set_receive_buffer(monitor, sock, self.receive_buffer)
            monitor.start()
        except (OSError, ValueError) as exc:
            sock.close()
            raise SourceUnavailable(
                f"cannot bind the {self.name} uevent netlink socket: {exc}"
            ) from exc
        report_buffer(self.name, self.obtained_buffer, self.receive_buffer)
        self._monitor, self._sock, self._fd = monitor, sock, fd

    async def batches(self) -> AsyncIterator[list[UEvent] | SourceOverflow]:
        """Yield every drained batch (and an overflow marker whenever events were lost).

        Holds no local reference to the monitor across a ``yield``, so ``close`` really
        closes the socket even while this generator is suspended.
        """
        self.start()
        failures = 0
        while self._monitor is not None:
            try:
                await anyio.wait_readable(self._fd)
            except anyio.ClosedResourceError:
                return
            more = True
            while more and self._monitor is not None:
                items, more, unexplained = self._drain()
                for item in items:
                    kept: list[UEvent] = []
                    if (isinstance(item, SourceOverflow) and item.error.startswith("ENOBUFS")
                            and not self.keep_queued):
                        # Discard what is queued (the rescan covers it), a slice a turn, but
                        # for what only a uevent says: it follows the marker, in order.
                        dropped, facts = await drain_after_loss(
                            lambda: self._sock, 65536, self._trusted)
                        kept = facts.events()
                        log.debug("%s uevent source lost events (%s; %d queued dropped, "
                                  "%d kept)", self.name, item.error, dropped, len(kept))
                        item = SourceOverflow(item.error, dropped, facts.unkept)
                    yield item
                    if kept:
                        yield kept
                if unexplained:
                    # An error we could not clear: back off instead of spinning on it.
                    failures += 1
                    await anyio.sleep(min(0.01 * 2**failures, 1.0))
                    break
                failures = 0
                if more:  # let requests and other tasks in between batches of a backlog
                    await end_turn()

    def _drain(self) -> tuple[list[list[UEvent] | SourceOverflow], bool, bool]:
        """Receive until the queue is empty, a batch is full, or an error (then stop there).

        Returns ``(items, more, unexplained)``: ``more`` when the queue may hold more,
        ``unexplained`` when an error left no socket error or errno to explain it.
        """
        items: list[list[UEvent] | SourceOverflow] = []
        batch: list[UEvent] = []
        while len(batch) < MAX_BATCH:
            monitor = self._monitor
            if monitor is None:
                break
            try:
                device = monitor.poll(timeout=0)
            except InterruptedError:
                continue
            except BlockingIOError:
                device = None
            except (OSError, ValueError, OverflowError, MemoryError) as exc:
                # pyudev raises 'Error while polling fd' on POLLERR and, as the error is
                # never read, forever after (pyudev#194): reading SO_ERROR clears it.
                if batch:
                    items.append(batch)
                overflow, explained = self._take_error(exc)
                items.append(overflow)
                return items, explained, not explained
            if device is None:
                if batch:
                    items.append(batch)
                return items, False, False
            try:
                event = self._to_uevent(device)
            except ValueError as exc:  # UnicodeDecodeError: pyudev decodes strictly
                if batch:
                    items.append(batch)
                    batch = []
                # The watcher says it (as a loss, at most so often): not a line per uevent.
                log.debug("%s uevent source: undecodable uevent skipped: %s", self.name, exc)
                items.append(SourceOverflow(error=f"undecodable uevent: {exc}"))
                continue
            if event is not None:
                batch.append(event)
        if batch:
            items.append(batch)
        return items, True, False

    def _to_uevent(self, device: Any) -> UEvent | None:
        try:
            props: dict[str, str] = dict(device.properties)
        except ValueError:  # UnicodeDecodeError: pyudev decodes every value strictly
            props = _raw_properties(device)
        if "ACTION" not in props:
            action = device.action
            if action:
                props["ACTION"] = str(action)
        if props.get("SUBSYSTEM") not in self.subsystems:
            return None
        return UEvent.from_properties(props)

    def _trusted(self, data: bytes, address: Any,
                 ancdata: list[tuple[int, int, bytes]]) -> UEvent | None:
        """A raw message drained after a loss, as pyudev would deliver it: udevd's (or for
        the ``kernel`` kind, the kernel's), of a subsystem followed."""
        if self.name == "udev":
            event = parse_udev_message(data) if udevd_sent(address, ancdata) else None
        elif address[0] == 0 and subsystem_of(data) is not None:
            event = parse_kernel_uevent(data)
        else:
            event = None
        return event if event is not None and event.subsystem in self.subsystems else None

    def _take_error(self, exc: BaseException) -> tuple[SourceOverflow, bool]:
        """Read (and thereby clear) the socket's pending error; describe what was lost."""
        code = 0
        if self._sock is not None:
            try:
                code = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            except OSError:
                code = 0
        explained = bool(code)
        if not code and isinstance(exc, OSError) and exc.errno:
            code = exc.errno
            explained = True
        text = describe_errno(code) if code else f"receive failed: {exc}"
        return SourceOverflow(error=text), explained  # `batches` drains after an ENOBUFS

    def close(self) -> None:
        """Close the socket; a ``batches`` waiting on it ends (idempotent)."""
        self._closed = True
        monitor, self._monitor = self._monitor, None
        fd, self._fd = self._fd, -1
        if fd >= 0:
            # Without a running event loop nobody can be waiting on the fd.
            with contextlib.suppress(RuntimeError):
                anyio.notify_closing(fd)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        # Dropping the last reference makes libudev (udev_monitor_unref) close its fd.
        del monitor
