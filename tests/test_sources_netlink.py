"""The kernel uevent sources against this machine's real kernel, and source selection.

Every real-kernel test runs against both readers of the kernel's multicast group: the raw
stdlib socket (`KernelSource`, the default) and pyudev's (`NetlinkSource("kernel")`).

The only write to the real /sys is the word ``change`` into a PCI device's ``uevent``
file, which makes the kernel broadcast a synthetic uevent and changes nothing else.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from cli_helpers import run_main

from gpuwatch.core.uevent import UEvent
from gpuwatch.sources import (
    EventSource,
    InvalidSourceSpec,
    SourceOverflow,
    SourceUnavailable,
    open_source,
)
from gpuwatch.sources.kernel import KernelSource
from gpuwatch.sources.netlink import (
    DEFAULT_RECEIVE_BUFFER,
    NetlinkSource,
    describe_errno,
    set_receive_buffer,
    user_namespace_warning,
)
from gpuwatch.testing import example_gpu_host

PCI_DEVICES = Path("/sys/bus/pci/devices")
SEQNUM = Path("/sys/kernel/uevent_seqnum")

_Item = list[UEvent] | SourceOverflow
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)  # Linux value; Python lacks the name


def real_pci_device() -> tuple[str, Path]:
    """(DEVPATH, uevent file) of the first PCI device, or skip the test with the reason."""
    if os.geteuid() != 0:
        pytest.skip("needs root to write a PCI device's uevent file")
    try:
        addrs = sorted(os.listdir(PCI_DEVICES))
    except OSError:
        addrs = []
    if not addrs:
        pytest.skip("no PCI device under /sys/bus/pci/devices")
    dev = PCI_DEVICES / addrs[0]
    uevent = dev / "uevent"
    if not os.access(uevent, os.W_OK):
        pytest.skip(f"{uevent} is not writable")
    devpath = "/" + os.path.relpath(os.path.realpath(dev), "/sys")
    return devpath, uevent


def trigger_change(uevent: Path, times: int = 1) -> None:
    """The one allowed write: the word 'change', ``times`` times, as fast as possible."""
    with open(uevent, "w", encoding="ascii") as f:
        for _ in range(times):
            f.write("change")
            f.flush()


def current_seqnum() -> int:
    return int(SEQNUM.read_text())


@pytest.fixture(params=["raw", "pyudev"])
def reader(request: pytest.FixtureRequest) -> str:
    """Which reader of the kernel's uevents a test runs against."""
    return str(request.param)


def started_kernel_source(
    reader: str, receive_buffer: int | None = None, *, keep_queued: bool = False
) -> KernelSource | NetlinkSource:
    src: KernelSource | NetlinkSource = (
        KernelSource(receive_buffer=receive_buffer, keep_queued=keep_queued)
        if reader == "raw"
        else NetlinkSource("kernel", receive_buffer=receive_buffer, keep_queued=keep_queued)
    )
    try:
        src.start()
    except SourceUnavailable as exc:
        pytest.skip(f"no kernel uevent socket here: {exc}")
    return src


async def pump(src: EventSource, send: MemoryObjectSendStream[_Item]) -> None:
    """Forward the source's items, so the test can read them with timeouts."""
    async with send:
        batches: AsyncIterator[_Item] = src.batches()
        async for item in batches:
            await send.send(item)


async def next_matching(
    recv: MemoryObjectReceiveStream[_Item], devpath: str, after_seq: int
) -> UEvent:
    """The first event for ``devpath`` newer than ``after_seq`` (other events are skipped)."""
    while True:
        item = await recv.receive()
        if isinstance(item, SourceOverflow):
            continue
        for ev in item:
            if ev.devpath == devpath and int(ev.get("SEQNUM", "0")) > after_seq:
                return ev


# --- the real kernel -------------------------------------------------------------------------


async def test_kernel_source_delivers_a_synthetic_change(reader: str) -> None:
    devpath, uevent = real_pci_device()
    src = started_kernel_source(reader)
    send, recv = anyio.create_memory_object_stream[_Item](1000)
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg, recv:
                tg.start_soon(pump, src, send)
                before = current_seqnum()
                trigger_change(uevent)
                ev = await next_matching(recv, devpath, before)
                tg.cancel_scope.cancel()
    finally:
        src.close()
    assert ev.action == "change"
    assert ev.subsystem == "pci"
    assert ev.devpath == devpath
    assert ev.get("ACTION") == "change" and ev.get("SUBSYSTEM") == "pci"
    assert ev.get("PCI_SLOT_NAME") == uevent.parent.name
    assert src.name == "kernel"


async def test_default_receive_buffer_is_granted_to_root(reader: str) -> None:
    real_pci_device()  # the same root-only preconditions
    src = started_kernel_source(reader)
    try:
        # The kernel reports twice the requested size (half is bookkeeping).
        assert src.obtained_buffer >= DEFAULT_RECEIVE_BUFFER
    finally:
        src.close()


async def test_overflow_is_reported_and_the_source_keeps_delivering(reader: str) -> None:
    devpath, uevent = real_pci_device()
    src = started_kernel_source(reader, receive_buffer=4096)
    assert src.obtained_buffer < 64 * 1024, "the tiny buffer request was not honoured"
    # Flood the socket while nobody reads it: a few events fit, the rest are dropped.
    trigger_change(uevent, times=500)
    send, recv = anyio.create_memory_object_stream[_Item](10_000)
    overflow: SourceOverflow | None = None
    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg, recv:
                tg.start_soon(pump, src, send)
                while overflow is None:
                    item = await recv.receive()
                    if isinstance(item, SourceOverflow):
                        overflow = item
                # Let the source drain what is left, until it has been quiet a while.
                quiet = False
                while not quiet:
                    quiet = True
                    with anyio.move_on_after(0.5):
                        await recv.receive()
                        quiet = False
                before = current_seqnum()
                trigger_change(uevent)
                fresh = await next_matching(recv, devpath, before)
                tg.cancel_scope.cancel()
    finally:
        src.close()
    assert overflow is not None
    assert overflow.error == "ENOBUFS: No buffer space available"
    assert fresh.action == "change" and fresh.subsystem == "pci"


async def _after_a_loss(src: KernelSource | NetlinkSource, uevent: Path,
                        devpath: str) -> tuple[list[SourceOverflow], list[int]]:
    """Overflow ``src`` (nobody reads it while 300 synthetic uevents come), then read until
    it has been quiet a while: the losses, and the SEQNUMs of the burst's uevents read."""
    before = current_seqnum()
    trigger_change(uevent, times=300)
    send, recv = anyio.create_memory_object_stream[_Item](10_000)
    losses: list[SourceOverflow] = []
    seqnums: list[int] = []
    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg, recv:
                tg.start_soon(pump, src, send)
                quiet = False
                while not quiet:
                    quiet = True
                    with anyio.move_on_after(0.5):
                        item = await recv.receive()
                        quiet = False
                        if isinstance(item, SourceOverflow):
                            losses.append(item)
                        else:
                            seqnums += [int(e.get("SEQNUM", "0")) for e in item
                                        if e.devpath == devpath]
                tg.cancel_scope.cancel()
    finally:
        src.close()
    return losses, [n for n in seqnums if n > before]


async def test_a_recording_source_keeps_what_the_kernel_queued_before_a_loss(
    reader: str
) -> None:
    """The kernel reports ENOBUFS before the uevents it did queue. A watcher's source discards
    those (its rescan covers them); with ``keep_queued`` (what ``gpuwatch record`` opens, as no
    rescan covers a recording) they are delivered, in order, so the recording's gap is only
    what the kernel dropped."""
    devpath, uevent = real_pci_device()
    src = started_kernel_source(reader, receive_buffer=4096, keep_queued=True)
    losses, kept = await _after_a_loss(src, uevent, devpath)
    assert losses and losses[0].error == "ENOBUFS: No buffer space available"
    assert all(loss.dropped == 0 for loss in losses)
    assert kept, "the uevents queued before the loss were discarded"
    assert kept == sorted(kept)
    # The watcher's source (the default) discards them: that is what a rescan is for.
    src = started_kernel_source(reader, receive_buffer=4096)
    losses, kept = await _after_a_loss(src, uevent, devpath)
    assert losses and losses[0].dropped > 0 and kept == []


async def test_close_ends_a_waiting_batches(reader: str) -> None:
    src = started_kernel_source(reader)
    ended = False

    async def consume() -> None:
        nonlocal ended
        async for _ in src.batches():
            pass
        ended = True

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.sleep(0.1)
            src.close()
    assert ended
    with pytest.raises(SourceUnavailable):
        src.start()


# --- the receive buffer without privilege -----------------------------------------------------


class _UnprivilegedMonitor:
    """Stands in for a pyudev Monitor whose SO_RCVBUFFORCE is refused (no CAP_NET_ADMIN)."""

    def set_receive_buffer_size(self, size: int) -> None:
        raise PermissionError(1, "Operation not permitted")


def _rmem_max() -> int:
    try:
        return int(Path("/proc/sys/net/core/rmem_max").read_text())
    except (OSError, ValueError):
        pytest.skip("net.core.rmem_max is not readable")


def test_unprivileged_buffer_falls_back_to_what_the_kernel_allows() -> None:
    cap = _rmem_max()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # start small
        obtained = set_receive_buffer(_UnprivilegedMonitor(), sock, DEFAULT_RECEIVE_BUFFER)
        assert obtained == sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    assert obtained == 2 * min(DEFAULT_RECEIVE_BUFFER, cap)


def test_unprivileged_fallback_never_shrinks_a_bigger_buffer() -> None:
    cap = _rmem_max()
    if os.geteuid() != 0:
        pytest.skip("needs root to give the socket more than rmem_max first")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        big = 4 * cap
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, big)
        obtained = set_receive_buffer(_UnprivilegedMonitor(), sock, 8 * cap)
    assert obtained == 2 * big


# --- pure helpers -------------------------------------------------------------------------------


def test_user_namespace_warning() -> None:
    assert user_namespace_warning("         0          0 4294967295\n") is None
    warning = user_namespace_warning("         0     100000      65536\n")
    assert warning is not None and "user namespace" in warning and "silent" in warning
    assert user_namespace_warning("") is not None  # no mapping at all is not the host either


def test_namespace_warning_reaches_the_source(tmp_path: Path) -> None:
    uid_map = tmp_path / "uid_map"
    uid_map.write_text("0 1000 1\n")
    assert len(NetlinkSource("kernel", uid_map_path=str(uid_map)).warnings) == 1
    assert len(KernelSource(uid_map_path=str(uid_map)).warnings) == 1
    uid_map.write_text("0 0 4294967295\n")
    assert NetlinkSource("kernel", uid_map_path=str(uid_map)).warnings == []
    assert KernelSource(uid_map_path=str(uid_map)).warnings == []


def test_describe_errno() -> None:
    assert describe_errno(105) == "ENOBUFS: No buffer space available"


# --- choosing a source -------------------------------------------------------------------------


def test_explicit_udev_without_udevd_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(SourceUnavailable, match="udevd"):
        open_source("udev", root=tmp_path)


def test_auto_picks_the_raw_kernel_source(tmp_path: Path) -> None:
    src = open_source("auto", tmp_path)
    assert isinstance(src, KernelSource)
    assert src.name == "kernel"
    assert src.obtained_buffer == 0  # built, not started


def test_auto_stays_kernel_and_udev_is_pyudev_when_udevd_runs(tmp_path: Path) -> None:
    control = tmp_path / "run" / "udev" / "control"
    control.parent.mkdir(parents=True)
    control.touch()
    assert isinstance(open_source("auto", tmp_path), KernelSource)
    src = open_source("udev", tmp_path)
    assert isinstance(src, NetlinkSource)
    assert src.name == "udev"


def _udevd_runs_under(root: Path) -> Path:
    control = root / "run" / "udev" / "control"
    control.parent.mkdir(parents=True)
    control.touch()
    return root


def test_udev_without_pyudev_is_one_line_exit_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """pyudev is imported for ``--source udev`` only, so a host may lack it (or libudev's
    binding): asking for that source was an internal error (exit 1, "ModuleNotFoundError")
    instead of an unusable source (one line, exit 2), as a missing udevd is."""
    host = example_gpu_host(tmp_path / "host")
    _udevd_runs_under(host.root)
    monkeypatch.setitem(sys.modules, "pyudev", None)  # `import pyudev` raises ImportError
    monkeypatch.delitem(sys.modules, "gpuwatch.sources.netlink")
    with pytest.raises(SourceUnavailable, match="needs pyudev"):
        open_source("udev", host.root)
    assert isinstance(open_source("kernel", host.root), KernelSource)  # never needs it
    for command in (["watch", "--log", str(tmp_path / "log.jsonl")],
                    ["record", "--out", str(tmp_path / "capture.jsonl")]):
        code, out, err = run_main(capsys, *command, "--source", "udev",
                                  "--root", str(host.root))
        assert (code, out, err.count("\n")) == (2, "", 1), (command, err)
        assert "needs pyudev" in err and "use --source kernel" in err
        assert "internal error" not in err


def test_udev_with_a_control_path_that_cannot_be_checked_is_one_line_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A root whose ``run/udev/control`` cannot even be looked up (here: longer than
    PATH_MAX, though the root itself is a folder) was an internal error, exit 1."""
    root = tmp_path
    while len(str(root)) < 4000:
        root /= "d" * 200
    root /= "e" * (4090 - len(str(root)))
    root.mkdir(parents=True)
    with pytest.raises(SourceUnavailable, match="cannot be checked"):
        open_source("udev", root)
    code, out, err = run_main(capsys, "watch", "--source", "udev", "--root", str(root),
                              "--log", str(tmp_path / "log.jsonl"))
    assert (code, out, err.count("\n")) == (2, "", 1), err
    assert "cannot be checked" in err and "internal error" not in err


def test_kernel_spec_and_receive_buffer_are_passed_through(tmp_path: Path) -> None:
    src = open_source("kernel", tmp_path, receive_buffer=4096)
    assert isinstance(src, KernelSource)
    assert (src.name, src.receive_buffer) == ("kernel", 4096)
    assert isinstance(src, EventSource)


def test_record_opens_its_source_keeping_what_is_queued_after_a_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``gpuwatch record`` has no rescan: a loss must not cost it the queued uevents too."""
    from gpuwatch.cli import record_cmd

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    asked: list[dict[str, object]] = []

    def spy(spec: str, root: str | os.PathLike[str], **kw: object) -> EventSource:
        asked.append({"spec": spec, **kw})
        return open_source(f"file:{empty}", root)

    monkeypatch.setattr(record_cmd, "open_source", spy)
    code, out, err = run_main(capsys, "record", "--root", str(tmp_path), "--source", "kernel")
    assert (code, out) == (0, ""), err
    assert asked == [{"spec": "kernel", "keep_queued": True}]
    assert open_source("kernel", tmp_path, keep_queued=True).keep_queued  # type: ignore[attr-defined]
    assert not open_source("kernel", tmp_path).keep_queued  # type: ignore[attr-defined]


def test_unknown_spec_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(InvalidSourceSpec, match="unknown source"):
        open_source("netlink", tmp_path)


# --- udevd's messages, as root sends them ------------------------------------------------------


def _murmur2(data: bytes) -> int:
    """libudev's hash of a subsystem name (MurmurHash2, seed 0): its filter compares it."""
    m, h = 0x5BD1E995, len(data) & 0xFFFFFFFF
    whole = len(data) - len(data) % 4
    for (k,) in struct.iter_unpack("<I", data[:whole]):
        k = (k * m) & 0xFFFFFFFF
        k = ((k ^ (k >> 24)) * m) & 0xFFFFFFFF
        h = ((h * m) & 0xFFFFFFFF) ^ k
    tail = data[whole:]
    if tail:
        h ^= int.from_bytes(tail, "little")
        h = (h * m) & 0xFFFFFFFF
    h = ((h ^ (h >> 13)) * m) & 0xFFFFFFFF
    return h ^ (h >> 15)


def udevd_message(subsystem: bytes, props: dict[str, bytes]) -> bytes:
    """A message as udevd multicasts it: the ``libudev`` header, then the properties."""
    body = b"".join(key.encode() + b"=" + value + b"\0" for key, value in props.items())
    return (b"libudev\0" + struct.pack(">I", 0xFEEDCAFE) + struct.pack("=III", 40, 40, len(body))
            + struct.pack(">II", _murmur2(subsystem), 0) + struct.pack("=II", 0, 0) + body)


async def test_the_udev_source_keeps_a_wedge_whose_task_name_is_not_utf8() -> None:
    """pyudev decodes each property strictly: a ``TASK=`` process name with a byte that is
    not UTF-8 (any process may name itself so) cost the whole uevent, reported as lost
    events, and the wedge with it (a rescan cannot see a wedge). It arrives, with the
    byte kept as the kernel source keeps it."""
    if os.geteuid() != 0:
        pytest.skip("only root may send to udevd's multicast group")
    src = NetlinkSource("udev", subsystems={"drm"})
    try:
        src.start()
    except SourceUnavailable as exc:
        pytest.skip(f"no udev netlink monitor here: {exc}")
    card = b"/devices/pci0000:00/0000:00:02.0/drm/card0"
    message = udevd_message(b"drm", {
        "ACTION": b"change", "DEVPATH": card, "SUBSYSTEM": b"drm", "SEQNUM": b"1",
        "WEDGED": b"rebind", "PID": b"7", "TASK": b"gpu\xffjob"})
    send, recv = anyio.create_memory_object_stream[_Item](1000)
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 15) as udevd:
            udevd.bind((0, 0))
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg, recv:
                    tg.start_soon(pump, src, send)
                    udevd.sendto(message, (0, 2))  # group 2: udevd's
                    item = await recv.receive()
                    tg.cancel_scope.cancel()
    finally:
        src.close()
    assert not isinstance(item, SourceOverflow), item
    [event] = [ev for ev in item if ev.devpath == card.decode()]
    assert (event.action, event.get("WEDGED"), event.get("PID")) == ("change", "rebind", "7")
    assert event.get("TASK") == "gpu\udcffjob"
    assert event.get("TASK").encode("utf-8", "surrogateescape") == b"gpu\xffjob"
