"""What a netlink source keeps from the queue it drains after a loss: the uevents whose facts
no rescan can see (a PCI error recovery's step, a DRM wedge, a real bind), end to end.

After ENOBUFS the sources discard what the kernel still queued, as the watcher's rescan
re-reads sysfs; but sysfs keeps no health, so a ``FAILED_RECOVERY`` the kernel did deliver
was discarded with the rest and the model said ``ok``. The real kernel cannot be made to
send an ``ERROR_EVENT`` (a synthetic uevent's arguments refuse ``_``), so a scripted socket
stands in for the netlink one here: the sources read it exactly as they read the kernel's.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from gpuwatch.core.uevent import UEvent, parse_udev_message
from gpuwatch.core.uevent_facts import MAX_KEPT, LostFacts
from gpuwatch.sources import SourceOverflow
from gpuwatch.sources.kernel import KernelSource
from gpuwatch.sources.netlink import NetlinkSource
from gpuwatch.testing import SysRoot
from gpuwatch.watch.watcher import open_watcher
from tests.test_sources_kernel import message
from tests.test_sources_netlink import udevd_message

pytestmark = pytest.mark.timeout(60)

NV, IGPU, NIC = "0000:01:00.0", "0000:00:02.0", "0000:02:00.0"
ENOBUFS = OSError(errno.ENOBUFS, os.strerror(errno.ENOBUFS))
_Item = list[UEvent] | SourceOverflow


@dataclass(frozen=True)
class Msg:
    """One datagram: its bytes, its netlink sender ``(port, group)``, its sender's uid."""

    data: bytes
    address: tuple[int, int] = (0, 1)
    uid: int | None = 0


class FakeNetlink:
    """A netlink socket's receiving end, scripted: messages and errors (ENOBUFS, as the
    kernel reports a loss) come out in order, then EAGAIN. Its fd is a real socket's,
    readable while anything is scripted, so the sources wait on it as on the kernel's."""

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self.queue: deque[Msg | OSError] = deque()
        self.so_error = 0

    def push(self, items: Iterable[Msg | OSError]) -> None:
        self.queue.extend(items)
        self._w.send(b"!")

    def fileno(self) -> int:
        return self._r.fileno()

    def next(self) -> Msg:
        if not self.queue:
            try:
                while self._r.recv(4096):
                    pass
            except BlockingIOError:
                pass
            raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        item = self.queue.popleft()
        if isinstance(item, OSError):
            raise item
        return item

    def recv(self, size: int, flags: int = 0) -> bytes:
        return self.next().data[:size]

    def recvfrom(self, size: int, flags: int = 0) -> tuple[bytes, tuple[int, int]]:
        msg = self.next()
        return msg.data[:size], msg.address

    def recvmsg(self, size: int, ancsize: int = 0,
                flags: int = 0) -> tuple[bytes, list[tuple[int, int, bytes]], int, Any]:
        assert ancsize >= socket.CMSG_SPACE(12), "no room asked for the sender's credentials"
        msg = self.next()
        creds = ([] if msg.uid is None else
                 [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS,
                   struct.pack("=iII", 4242, msg.uid, 0))])
        return msg.data[:size], creds, 0, msg.address

    def getsockopt(self, level: int, option: int) -> int:
        assert (level, option) == (socket.SOL_SOCKET, socket.SO_ERROR)
        code, self.so_error = self.so_error, 0
        return code

    def close(self) -> None:
        self._r.close()
        self._w.close()


@dataclass
class FakeDevice:
    properties: Mapping[str, str]
    action: str


class FakeMonitor:
    """pyudev's monitor over the same script: it raises on a loss (pyudev#194: the error is
    left on the socket for SO_ERROR), as pyudev does on POLLERR."""

    def __init__(self, sock: FakeNetlink) -> None:
        self.sock = sock

    def poll(self, timeout: float = 0) -> FakeDevice | None:
        try:
            msg = self.sock.next()
        except BlockingIOError:
            return None
        except OSError as exc:
            self.sock.so_error = exc.errno or 0
            raise OSError("Error while polling fd") from None
        event = parse_udev_message(msg.data)
        assert event is not None
        return FakeDevice(event.to_properties(), event.action)


def kernel_source(sock: FakeNetlink, *, keep_queued: bool = False) -> KernelSource:
    src = KernelSource(uid_map_path="/nonexistent", keep_queued=keep_queued)
    src._sock, src._fd = sock, sock.fileno()  # type: ignore[assignment]
    return src


def udev_source(sock: FakeNetlink) -> NetlinkSource:
    src = NetlinkSource("udev", uid_map_path="/nonexistent")
    src._monitor = FakeMonitor(sock)
    src._sock, src._fd = sock, sock.fileno()  # type: ignore[assignment]
    return src


def kmsg(props: Mapping[str, str]) -> Msg:
    return Msg(message(props["ACTION"], props["DEVPATH"], dict(props)))


def umsg(props: Mapping[str, str], *, address: tuple[int, int] = (4242, 2),
         uid: int | None = 0) -> Msg:
    body = {k: v.encode() for k, v in props.items()}
    return Msg(udevd_message(props["SUBSYSTEM"].encode(), body), address, uid)


async def items_of(src: KernelSource | NetlinkSource) -> list[_Item]:
    """Everything the source yields until it has nothing more for 0.3 s."""
    out: list[_Item] = []
    batches = src.batches()
    with anyio.fail_after(20):
        while True:
            with anyio.move_on_after(0.3) as quiet:
                out.append(await anext(batches))
            if quiet.cancelled_caught:
                break
    await batches.aclose()
    return out


def failed(s: SysRoot, addr: str, error: str = "FAILED_RECOVERY") -> dict[str, str]:
    return s.uevent_props("change", addr, ERROR_EVENT=error, DEVICE_ONLINE="0")


# --- the sources --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["kernel", "udev"])
async def test_a_failed_recovery_queued_behind_a_loss_follows_the_overflow(
        host: SysRoot, kind: str) -> None:
    """Many plain uevents and one FAILED_RECOVERY behind an ENOBUFS: the plain ones are
    discarded (the rescan covers them), the failure comes right after the marker."""
    sock = FakeNetlink()
    msg = kmsg if kind == "kernel" else umsg
    plain = host.uevent_props("change", NIC)
    before = [msg(host.uevent_props("change", IGPU)) for _ in range(3)]
    sock.push([*before, ENOBUFS, *[msg(plain)] * 2000, msg(failed(host, NV)),
               *[msg(plain)] * 500])
    src = kernel_source(sock) if kind == "kernel" else udev_source(sock)
    try:
        items = await items_of(src)
    finally:
        src.close()
    assert [type(i).__name__ for i in items] == ["list", "SourceOverflow", "list"]
    first, overflow, kept = items
    assert isinstance(first, list) and len(first) == 3
    assert isinstance(overflow, SourceOverflow) and overflow.error.startswith("ENOBUFS")
    assert (overflow.dropped, overflow.unkept) == (2500, 0)
    assert isinstance(kept, list)
    assert [(e.action, e.get("ERROR_EVENT"), e.get("PCI_SLOT_NAME")) for e in kept] == [
        ("change", "FAILED_RECOVERY", NV)]


async def test_only_what_the_kernel_or_udevd_sent_is_kept(host: SysRoot) -> None:
    """The drain believes whom the source believes: the kernel (port 0) for the kernel
    source; for the udev one a multicast from root, as libudev does."""
    forged = Msg(kmsg(failed(host, NV)).data, address=(777, 0))
    sock = FakeNetlink()
    sock.push([ENOBUFS, forged])
    src = kernel_source(sock)
    try:
        items = await items_of(src)
    finally:
        src.close()
    assert [type(i).__name__ for i in items] == ["SourceOverflow"]
    sock = FakeNetlink()
    sock.push([ENOBUFS, umsg(failed(host, NV), uid=1000),
               umsg(failed(host, NV), address=(4242, 0)), umsg(failed(host, NV), uid=None),
               umsg(failed(host, IGPU))])
    udev = udev_source(sock)
    try:
        items = await items_of(udev)
    finally:
        udev.close()
    assert [type(i).__name__ for i in items] == ["SourceOverflow", "list"]
    assert [e.get("PCI_SLOT_NAME") for e in items[1]] == [IGPU]  # type: ignore[union-attr]


async def test_a_recording_source_still_gets_everything_queued(host: SysRoot) -> None:
    """``keep_queued`` (what ``record`` opens) delivers every queued uevent after the loss,
    not just those with facts."""
    sock = FakeNetlink()
    plain = kmsg(host.uevent_props("change", NIC))
    sock.push([ENOBUFS, plain, kmsg(failed(host, NV)), plain])
    src = kernel_source(sock, keep_queued=True)
    try:
        items = await items_of(src)
    finally:
        src.close()
    assert items[0] == SourceOverflow(items[0].error)  # type: ignore[union-attr]
    events = [e for item in items[1:] if isinstance(item, list) for e in item]
    assert [e.get("ERROR_EVENT") for e in events] == ["", "FAILED_RECOVERY", ""]


async def test_a_flood_of_facts_behind_a_loss_stays_bounded(host: SysRoot) -> None:
    """Tens of thousands of error-recovery uevents behind a loss: at most `MAX_KEPT` are
    kept, the newest (they decide the health the model ends with), and the rest counted."""
    sock = FakeNetlink()
    flood = [kmsg(failed(host, NV, "BEGIN_RECOVERY" if i % 2 else "FAILED_RECOVERY"))
             for i in range(3 * MAX_KEPT + 1)]
    sock.push([ENOBUFS, *flood])
    src = kernel_source(sock)
    try:
        items = await items_of(src)
    finally:
        src.close()
    overflow, kept = items
    assert isinstance(overflow, SourceOverflow) and isinstance(kept, list)
    assert len(kept) == MAX_KEPT
    assert overflow.unkept == overflow.dropped == len(flood) - MAX_KEPT
    seqnums = [int(e.get("SEQNUM")) for e in kept]
    assert seqnums == [int(e.data.split(b"SEQNUM=")[1].split(b"\0")[0])
                       for e in flood[-MAX_KEPT:]]
    assert kept[-1].get("ERROR_EVENT") == "FAILED_RECOVERY"


def test_lost_facts_bounds_bytes_and_keeps_a_flapping_bind_once(host: SysRoot) -> None:
    """The byte bound holds as the count bound does; a link flapping bind/unbind keeps one
    bind per function (between other facts), not one per flap; the rest carry nothing."""
    facts = LostFacts(max_count=100, max_bytes=1000)
    ev = UEvent.from_properties(failed(host, NV))
    for _ in range(10):
        facts.offer(ev, 300)
    assert (len(facts), facts.unkept) == (3, 7)
    facts = LostFacts()
    bind_nv, bind_nic = (UEvent.from_properties(host.uevent_props("bind", a)) for a in (NV, NIC))
    unbind = UEvent.from_properties(host.uevent_props("unbind", NV))
    synthetic = UEvent.from_properties(host.uevent_props("bind", NV, SYNTH_UUID="0"))
    for _ in range(500):
        assert not facts.offer(unbind, 300)
        assert not facts.offer(synthetic, 300)
        facts.offer(bind_nv, 300)
        facts.offer(bind_nic, 300)
    assert facts.events() == [bind_nv, bind_nic]
    facts.offer(ev, 300)
    facts.offer(bind_nv, 300)  # after a failure it counts again
    assert facts.events() == [bind_nv, bind_nic, ev, bind_nv]


async def test_a_wedge_behind_a_loss_is_kept_and_published(host: SysRoot) -> None:
    """A DRM wedge the kernel queued behind a loss: the card's function ends ``wedged`` and
    its ``gpu-wedged`` is published, with the recovery methods the uevent named."""
    card = host.uevent_props("change", host.devpath(NV) + "/drm/card1")
    sock = FakeNetlink()
    async with _watch(host, kernel_source(sock)) as w:
        async with w.subscribe(types={"gpu-wedged"}) as sub:
            sock.push([ENOBUFS, kmsg(card),
                       kmsg({**card, "WEDGED": "rebind,bus-reset", "PID": "7"}), kmsg(card)])
            with anyio.fail_after(20):
                wedged = await sub.receive()
        assert w.model.function(NV).health == "wedged"
    assert (wedged.addr, wedged.card, wedged.recovery, wedged.pid) == (
        NV, "card1", ["rebind", "bus-reset"], 7)


def test_a_udev_message_parses_as_libudev_reads_it() -> None:
    data = udevd_message(b"pci", {"ACTION": b"change", "DEVPATH": b"/devices/x",
                                  "SUBSYSTEM": b"pci", "ERROR_EVENT": b"FAILED_RECOVERY"})
    event = parse_udev_message(data)
    assert event is not None
    assert (event.action, event.devpath, event.subsystem) == ("change", "/devices/x", "pci")
    assert event.get("ERROR_EVENT") == "FAILED_RECOVERY"
    assert parse_udev_message(data[:30]) is None
    assert parse_udev_message(data[:8] + b"\0\0\0\0" + data[12:]) is None  # another version
    assert parse_udev_message(message("add", "/devices/x", {"SUBSYSTEM": "pci"})) is None


# --- through the watcher ------------------------------------------------------------------------


async def _until(sub: Any, until: str, count: int = 1) -> list[Any]:
    """The events up to the ``count``-th of type ``until``, then any within 0.3 s."""
    got: list[Any] = []
    with anyio.fail_after(20):
        while sum(e.type == until for e in got) < count:
            got.append(await sub.receive())
    with anyio.move_on_after(0.3):
        while True:
            got.append(await sub.receive())
    return got


def _watch(host: SysRoot, src: KernelSource | NetlinkSource) -> Any:
    return open_watcher(host.root, src, reconcile_interval=0, cdi_poll_interval=0)


@pytest.mark.parametrize("kind", ["kernel", "udev"])
async def test_a_failed_recovery_behind_a_loss_reaches_the_model_after_its_rescan(
        host: SysRoot, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    """The defect end to end: the function's health ends ``failed`` and its two recovery
    steps are published once each, after the rescan's ``resync``; a failure of a function
    gone by then is applied to nothing (the rescan removed it)."""
    sock = FakeNetlink()
    msg = kmsg if kind == "kernel" else umsg
    plain = msg(host.uevent_props("change", IGPU))
    gone = failed(host, NIC)
    types = {"device-error", "resync", "device-removed", "device-changed"}
    async with _watch(host, kernel_source(sock) if kind == "kernel" else udev_source(sock)) as w:
        assert w.model.function(NV).health == "ok"
        async with w.subscribe(types=types) as sub:
            host.remove_function(NIC)
            sock.push([*[plain] * 300, ENOBUFS, *[plain] * 3000, msg(gone),
                       msg(failed(host, NV, "BEGIN_RECOVERY")), *[plain] * 100,
                       msg(failed(host, NV)), *[plain] * 1000])
            events = await _until(sub, "device-error", 2)
        assert w.model.function(NV).health == "failed"
        assert NIC not in w.model.state.functions
    assert [e.type for e in events] == ["device-removed", "resync", "device-error",
                                        "device-error"]
    assert events[1].reason == "overflow"
    assert [(e.addr, e.error_event, e.health) for e in events[2:]] == [
        (NV, "BEGIN_RECOVERY", "recovering"), (NV, "FAILED_RECOVERY", "failed")]
    assert "events lost (ENOBUFS" in caplog.text and "of them with" not in caplog.text


async def test_kept_facts_are_applied_in_order_when_the_rescan_waits(host: SysRoot) -> None:
    """A second loss within the gap after a rescan waits for the next one; the facts its
    drain kept are applied at once, before the uevents that follow them: a failure the
    kernel queued before the loss, then a live bind that cleared it, ends ``ok``."""
    sock = FakeNetlink()
    async with _watch(host, kernel_source(sock)) as w:
        async with w.subscribe(types={"device-error", "device-changed"}) as sub:
            sock.push([ENOBUFS])  # the first loss: rescanned at once
            with anyio.fail_after(10):
                while w.resyncs < 1:
                    await anyio.sleep(0.01)
            sock.push([ENOBUFS, kmsg(failed(host, NV)), ENOBUFS])
            with anyio.fail_after(10):
                while w.model.function(NV).health != "failed":
                    await anyio.sleep(0.01)
            assert w.resyncs == 1  # the second loss's rescan is held for the gap
            sock.push([kmsg(host.uevent_props("bind", NV))])
            events = await _until(sub, "device-changed")
            with anyio.fail_after(10):
                while w.resyncs < 2:  # the held rescan keeps the health
                    await anyio.sleep(0.01)
        assert w.model.function(NV).health == "ok"
    assert [e.type for e in events] == ["device-error", "device-changed"]
    assert (events[0].health, events[1].changed, events[1].device.health) == (
        "failed", ["health"], "ok")


async def test_a_flood_of_facts_behind_a_loss_is_said_and_ends_with_the_last(
        host: SysRoot, caplog: pytest.LogCaptureFixture) -> None:
    """Past the bound the oldest facts go and the journal says so; the newest decide the
    health, so the model ends with the one the kernel reported last."""
    caplog.set_level(logging.WARNING, "gpuwatch")
    sock = FakeNetlink()
    flood = [kmsg(failed(host, NV, "FAILED_RECOVERY" if i % 2 else "BEGIN_RECOVERY"))
             for i in range(2 * MAX_KEPT)]
    async with _watch(host, kernel_source(sock)) as w:
        async with w.subscribe(types={"device-error"}) as sub:
            sock.push([ENOBUFS, *flood])
            with anyio.fail_after(20):
                got = [await sub.receive() for _ in range(MAX_KEPT)]
            with anyio.move_on_after(0.3):
                got.append(await sub.receive())
        assert w.model.function(NV).health == "failed"
    assert len(got) == MAX_KEPT and got[-1].error_event == "FAILED_RECOVERY"
    assert (f"{MAX_KEPT} queued dropped, {MAX_KEPT} of them with error-recovery, wedge or "
            "bind facts past the bound") in caplog.text
