"""The raw kernel uevent source: its parser on any bytes, and what it refuses from the socket.

The real-kernel delivery, buffer and overflow tests run for this source and the pyudev one
alike in test_sources_netlink.py; these are the parts only the raw socket has.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuwatch.core.uevent import UDEV_MAGIC, UEvent, parse_kernel_uevent, subsystem_of
from gpuwatch.sources import SourceUnavailable
from gpuwatch.sources.kernel import MAX_READ, NETLINK_KOBJECT_UEVENT, KernelSource

# --- the parser -----------------------------------------------------------------------------

_word = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\0=@"), min_size=1
)
_value = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"))


def message(action: str, devpath: str, props: dict[str, str]) -> bytes:
    """A uevent laid out as the kernel sends it (lib/kobject_uevent.c)."""
    body = "".join(f"{k}={v}\0" for k, v in props.items())
    return f"{action}@{devpath}\0".encode() + body.encode()


def test_parses_a_real_shaped_pci_uevent() -> None:
    data = (
        b"bind@/devices/pci0000:00/0000:00:02.0\0ACTION=bind\0"
        b"DEVPATH=/devices/pci0000:00/0000:00:02.0\0SUBSYSTEM=pci\0DRIVER=vfio-pci\0"
        b"PCI_SLOT_NAME=0000:00:02.0\0SEQNUM=4711\0"
    )
    ev = parse_kernel_uevent(data)
    assert ev == UEvent(
        "bind",
        "/devices/pci0000:00/0000:00:02.0",
        "pci",
        {
            "ACTION": "bind",
            "DEVPATH": "/devices/pci0000:00/0000:00:02.0",
            "SUBSYSTEM": "pci",
            "DRIVER": "vfio-pci",
            "PCI_SLOT_NAME": "0000:00:02.0",
            "SEQNUM": "4711",
        },
    )
    assert subsystem_of(data) == b"pci"


@given(
    action=_word,
    devpath=_value.filter(lambda v: "\0" not in v),
    props=st.dictionaries(_word.filter(lambda k: k not in ("ACTION", "DEVPATH")), _value),
)
def test_any_well_formed_message_round_trips(
    action: str, devpath: str, props: dict[str, str]
) -> None:
    ev = parse_kernel_uevent(message(action, devpath, props))
    assert ev is not None
    assert (ev.action, ev.devpath) == (action, devpath)
    assert ev.subsystem == props.get("SUBSYSTEM", "")
    assert dict(ev.properties) == {"ACTION": action, "DEVPATH": devpath, **props}
    if "SUBSYSTEM" in props:
        assert subsystem_of(message(action, devpath, props)) == props["SUBSYSTEM"].encode()


@given(st.binary(max_size=512))
def test_any_bytes_parse_or_are_refused_without_raising(data: bytes) -> None:
    ev = parse_kernel_uevent(data)
    if ev is not None:
        assert b"@" in data.split(b"\0", 1)[0]
        # Whatever the bytes, the strings name the same bytes again (sysfs paths round-trip).
        assert ev.devpath.encode("utf-8", "surrogateescape") in data
    sub = subsystem_of(data)
    assert sub is None or b"\0SUBSYSTEM=" + sub in data


def test_odd_bytes_in_a_devpath_survive() -> None:
    raw = b"/devices/odd\xff\xfe"
    ev = parse_kernel_uevent(b"change@" + raw + b"\0SUBSYSTEM=pci\0")
    assert ev is not None
    assert os.fsencode(ev.devpath) == raw


def test_not_a_kernel_uevent_is_refused() -> None:
    assert parse_kernel_uevent(UDEV_MAGIC + b"\0\0\0\0ACTION=add\0") is None
    assert parse_kernel_uevent(b"no header here\0ACTION=add\0") is None
    assert parse_kernel_uevent(b"") is None
    assert subsystem_of(b"add@/x\0ACTION=add\0") is None


def test_first_of_a_repeated_key_counts_in_both_parser_and_filter() -> None:
    data = b"add@/devices/x\0SUBSYSTEM=pci\0SUBSYSTEM=drm\0"
    ev = parse_kernel_uevent(data)
    assert ev is not None and ev.subsystem == "pci"
    assert subsystem_of(data) == b"pci"


def test_entries_without_equals_are_skipped_and_the_header_fills_gaps() -> None:
    ev = parse_kernel_uevent(b"remove@/devices/y\0garbage\0=nokey\0SUBSYSTEM=drm\0")
    assert ev is not None
    assert dict(ev.properties) == {
        "SUBSYSTEM": "drm",
        "ACTION": "remove",
        "DEVPATH": "/devices/y",
    }


# --- the socket -------------------------------------------------------------------------------


def started(subsystems: frozenset[str] | None = None) -> KernelSource:
    src = KernelSource() if subsystems is None else KernelSource(subsystems=subsystems)
    try:
        src.start()
    except SourceUnavailable as exc:
        pytest.skip(f"no kernel uevent socket here: {exc}")
    return src


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the kernel lets only root send "
                    "on NETLINK_KOBJECT_UEVENT")
async def test_a_forged_uevent_from_another_process_is_dropped() -> None:
    """A process with CAP_NET_ADMIN may unicast to our netlink port; only the kernel (port 0)
    is believed."""
    src = started()
    try:
        assert src._sock is not None
        port = src._sock.getsockname()[0]
        forged = message("add", "/devices/forged", {"SUBSYSTEM": "pci", "ACTION": "add"})
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_KOBJECT_UEVENT) as s:
            s.bind((0, 0))
            s.sendto(forged, (port, 0))
        received: list[UEvent] = []
        with anyio.move_on_after(1):
            async for item in src.batches():
                if isinstance(item, list):
                    received.extend(item)
        assert src.rejected >= 1
        assert not any(ev.devpath == "/devices/forged" for ev in received)
    finally:
        src.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the kernel lets only root send "
                    "on NETLINK_KOBJECT_UEVENT")
def test_a_flood_of_messages_it_drops_is_read_in_bounded_slices() -> None:
    """Messages dropped unparsed (forged ones here; the same for a storm of uevents of
    subsystems not followed) count against one drain's work: a drain that only stopped at
    256 kept events or an empty queue held the event loop as long as the flood lasted."""
    src = started()
    try:
        assert src._sock is not None
        port = src._sock.getsockname()[0]
        forged = message("add", "/devices/forged", {"SUBSYSTEM": "pci", "ACTION": "add"})
        sent = 3 * MAX_READ + 5
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_KOBJECT_UEVENT) as s:
            s.bind((0, 0))
            for _ in range(sent):
                s.sendto(forged, (port, 0))
        slices = []
        while True:
            batch, overflow, more = src._drain()
            assert batch == [] and overflow is None
            slices.append(src.rejected - sum(slices))
            if not more:
                break
        assert src.rejected == sent
        assert max(slices) <= MAX_READ and len(slices) >= 4
    finally:
        src.close()


async def test_subsystems_outside_the_filter_are_dropped() -> None:
    """Two sources see the same real PCI uevent: the one following only ``drm`` drops it."""
    if os.geteuid() != 0:
        pytest.skip("writing a synthetic uevent needs root")
    bus = Path("/sys/bus/pci/devices")
    addrs = sorted(os.listdir(bus)) if bus.is_dir() else []
    if not addrs or not os.access(bus / addrs[0] / "uevent", os.W_OK):
        pytest.skip("no PCI device with a writable uevent file")
    pci, drm = started(), started(frozenset({"drm"}))
    try:
        (bus / addrs[0] / "uevent").write_text("change")  # the one allowed write
        seen: dict[str, list[UEvent]] = {"pci": [], "drm": []}

        async def collect(name: str, src: KernelSource, scope: anyio.CancelScope) -> None:
            async for item in src.batches():
                if isinstance(item, list):
                    seen[name].extend(item)
                    if name == "pci" and any(ev.get("PCI_SLOT_NAME") == addrs[0]
                                             for ev in item):
                        await anyio.sleep(0.2)  # the drm source's turn to get it, if it would
                        scope.cancel()

        # Until the PCI source has it (bounded): a loaded machine may take more than a moment.
        with anyio.move_on_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(collect, "pci", pci, tg.cancel_scope)
                tg.start_soon(collect, "drm", drm, tg.cancel_scope)
        assert any(ev.get("PCI_SLOT_NAME") == addrs[0] for ev in seen["pci"])
        assert all(ev.subsystem == "drm" for ev in seen["drm"])
    finally:
        pci.close()
        drm.close()


async def test_close_before_start_refuses_to_start() -> None:
    src = KernelSource()
    src.close()
    with pytest.raises(SourceUnavailable, match="closed"):
        src.start()


def test_the_default_source_never_imports_pyudev(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from gpuwatch.sources import open_source\n"
        f"src = open_source('auto', {str(tmp_path)!r})\n"
        "src.start(); src.close()\n"
        "print('pyudev' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


async def test_an_overflows_drain_lets_other_tasks_run_between_slices(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After ENOBUFS a source discards what is queued; a full 128 MiB queue holds a million
    messages, so it does that a slice a turn and a probe waiting meanwhile is served between
    slices. A datagram socket stands in for the netlink one (the drain reads any socket)."""
    from gpuwatch import sources

    monkeypatch.setattr(sources, "DRAIN_SLICE", 10)
    reader, writer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    reader.setblocking(False)
    for i in range(95):
        writer.send(b"uevent %d" % i)
    ticks = 0
    seen_at_slice: list[int] = []
    real_drain = sources.drain_to_eagain

    def counted(sock: socket.socket, max_message: int = 65536, limit: int = 1,
                keep: sources.Keep | None = None) -> int:
        seen_at_slice.append(ticks)
        return real_drain(sock, max_message, limit, keep)

    monkeypatch.setattr(sources, "drain_to_eagain", counted)

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    try:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker)
                await anyio.lowlevel.checkpoint()
                dropped = await sources.drain_lost(lambda: reader)
                tg.cancel_scope.cancel()
    finally:
        reader.close()
        writer.close()
    assert dropped == 95
    assert len(seen_at_slice) == 10  # nine full slices and the one that found the end
    assert all(b > a for a, b in itertools.pairwise(seen_at_slice))


def test_a_capped_receive_buffer_is_a_warning(monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """Without CAP_NET_ADMIN (SO_RCVBUFFORCE refused here) the kernel caps the buffer at
    net.core.rmem_max: said as a warning, since a storm then overflows it; a granted one is
    only an info line."""
    import logging

    from gpuwatch.sources import kernel

    def refused(sock: socket.socket) -> object:
        def force(size: int) -> None:
            raise PermissionError(1, "Operation not permitted")
        return force

    caplog.set_level(logging.INFO, logger="gpuwatch.sources")
    granted = started()
    granted.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    monkeypatch.setattr(kernel, "_force", refused)
    capped = KernelSource(receive_buffer=2**31 - 1)
    try:
        capped.start()
    except SourceUnavailable as exc:
        pytest.skip(f"no kernel uevent socket here: {exc}")
    finally:
        capped.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(
        f"kernel uevent source: receive buffer capped at {capped.obtained_buffer // 2} bytes, "
        "not the 2147483647 asked for")


def test_a_buffer_capped_below_the_ask_is_a_warning_though_the_kernel_reports_more(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """SO_RCVBUF reads back twice what was set: asking for 1.5 times net.core.rmem_max
    without CAP_NET_ADMIN gets rmem_max, read back as twice rmem_max, more than the ask.
    That passed as granted (an info line) though a third of the buffer asked for was
    missing; it is the capped warning, and says the usable size, rmem_max."""
    import logging

    from gpuwatch.sources import kernel

    try:
        rmem_max = int(Path("/proc/sys/net/core/rmem_max").read_text())
    except (OSError, ValueError):
        pytest.skip("net.core.rmem_max is not readable")
    if not 4096 <= rmem_max <= (2**31 - 1) // 3:
        pytest.skip(f"net.core.rmem_max {rmem_max} leaves no room for a request above it")

    def refused(sock: socket.socket) -> object:
        def force(size: int) -> None:
            raise PermissionError(1, "Operation not permitted")
        return force

    monkeypatch.setattr(kernel, "_force", refused)
    caplog.set_level(logging.INFO, logger="gpuwatch.sources")
    for asked in (4096, rmem_max + rmem_max // 2):
        src = KernelSource(receive_buffer=asked)
        try:
            src.start()
        except SourceUnavailable as exc:
            pytest.skip(f"no kernel uevent socket here: {exc}")
        finally:
            src.close()
    small, big = [r for r in caplog.records if "receive buffer" in r.getMessage()]
    assert big.levelno == logging.WARNING, big.getMessage()
    assert small.levelno == logging.INFO
    assert small.getMessage() == "kernel uevent source: receive buffer 4096 bytes (asked for 4096)"
    assert big.getMessage().startswith(
        f"kernel uevent source: receive buffer capped at {rmem_max} bytes, "
        f"not the {rmem_max + rmem_max // 2} asked for")
