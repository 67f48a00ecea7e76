"""The event path with the real kernel: synthetic uevents on a real PCI device, read from a fixture.

The only write to the real /sys is a word (``change``, ``bind`` …) into a device's ``uevent``
file: the kernel broadcasts a uevent and changes nothing. The watcher reads a fixture root
that mirrors the device at its real DEVPATH, so what it reports is what the test changed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from gpuwatch.watch.watcher import open_watcher

REAL_BUS = "/sys/bus/pci/devices"


def real_device() -> tuple[str, str]:
    """``(addr, devpath)`` of a real PCI device whose uevent file we may write, else skip."""
    if os.geteuid() != 0:
        pytest.skip("writing a synthetic uevent needs root")
    try:
        addrs = sorted(os.listdir(REAL_BUS))
    except OSError:
        addrs = []
    for addr in addrs:
        uevent = f"{REAL_BUS}/{addr}/uevent"
        if os.access(uevent, os.W_OK):
            devpath = os.path.realpath(f"{REAL_BUS}/{addr}")[len("/sys"):]
            return addr, devpath
    pytest.skip("no PCI device with a writable uevent file on this machine")


def kick(addr: str, word: str = "change") -> None:
    """Ask the kernel to broadcast a synthetic uevent. Only these words, only this file."""
    assert word in ("add", "remove", "change", "bind", "unbind")
    with open(f"{REAL_BUS}/{addr}/uevent", "w") as fh:
        fh.write(word)


def mirror(root: Path, addr: str, devpath: str, driver: str) -> Path:
    """A fixture function at the real DEVPATH, laid out like sysfs, with ``driver``."""
    sys_dir = root / "sys"
    dev_dir = sys_dir / devpath.lstrip("/")
    dev_dir.mkdir(parents=True)
    for attr in ("vendor", "device", "class"):
        (dev_dir / attr).write_text(Path(f"{REAL_BUS}/{addr}/{attr}").read_text())
    bus = sys_dir / "bus/pci/devices"
    bus.mkdir(parents=True)
    os.symlink(os.path.relpath(dev_dir, bus), bus / addr)
    set_driver(root, devpath, driver)
    return dev_dir


def set_driver(root: Path, devpath: str, driver: str) -> None:
    dev_dir = root / "sys" / devpath.lstrip("/")
    link = dev_dir / "driver"
    if link.is_symlink():
        link.unlink()
    if driver:
        drv = root / "sys/bus/pci/drivers" / driver
        drv.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(drv, dev_dir), link)


async def test_real_kernel_uevent_drives_the_model(tmp_path: Path) -> None:
    addr, devpath = real_device()
    mirror(tmp_path, addr, devpath, "virtio-pci")
    async with open_watcher(tmp_path, "kernel", reconcile_interval=0, cdi_poll_interval=0) as w:
        assert w.source.name == "kernel"
        async with w.subscribe(addrs=[addr]) as sub:
            set_driver(tmp_path, devpath, "vfio-pci")
            kick(addr, "change")
            with anyio.fail_after(10):
                event = await sub.receive()
            assert (event.type, event.addr, event.old, event.new) == (
                "driver-changed", addr, "virtio-pci", "vfio-pci")
            set_driver(tmp_path, devpath, "")
            kick(addr, "unbind")
            with anyio.fail_after(10):
                event = await sub.receive()
            assert (event.old, event.new) == ("vfio-pci", "")
        assert w.probe("display-driver", addr=addr) == ""


async def test_a_real_bind_and_unbind_take_the_plain_lane(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel's own spelling of ``PCI_ID`` and ``PCI_CLASS`` in a real uevent vouches for
    the card: a bind or unbind of a plain function (an IOMMU group, no SR-IOV) is read through
    its driver link alone, with no full read of the function."""
    from gpuwatch.hostfs import scan as scan_mod

    addr, devpath = real_device()
    dev_dir = mirror(tmp_path, addr, devpath, "virtio-pci")
    group = tmp_path / "sys/kernel/iommu_groups/7"
    (group / "devices").mkdir(parents=True)
    os.symlink(os.path.relpath(group, dev_dir), dev_dir / "iommu_group")
    full: list[str] = []
    real = scan_mod._read_function_dir
    monkeypatch.setattr(scan_mod, "_read_function_dir",
                        lambda d, a, p, **kw: full.append(a) or real(d, a, p, **kw))
    async with open_watcher(tmp_path, "kernel", reconcile_interval=0, cdi_poll_interval=0) as w:
        assert full == [addr]  # the initial scan
        async with w.subscribe(addrs=[addr], types=["driver-changed"]) as sub:
            for word, driver, was in (("unbind", "", "virtio-pci"),
                                      ("bind", "virtio-pci", "")):
                set_driver(tmp_path, devpath, driver)
                kick(addr, word)
                with anyio.fail_after(10):
                    event = await sub.receive()
                assert (event.old, event.new) == (was, driver)
    assert full == [addr]  # nothing read in full since


async def test_real_overflow_is_survived_and_resynced(tmp_path: Path) -> None:
    addr, devpath = real_device()
    mirror(tmp_path, addr, devpath, "virtio-pci")
    async with open_watcher(tmp_path, "kernel", reconcile_interval=0, cdi_poll_interval=0,
                            receive_buffer=4096) as w, w.subscribe() as sub:
        set_driver(tmp_path, devpath, "vfio-pci")
        for _ in range(400):  # without yielding: the tiny socket buffer must overflow
            kick(addr)
        got = []
        with anyio.fail_after(20):
            while not any(e.type == "resync" for e in got):
                got.append(await sub.receive())
        resync = next(e for e in got if e.type == "resync")
        assert resync.reason == "overflow"
        assert any(e.type == "driver-changed" and e.new == "vfio-pci" for e in got)
        assert w.probe("display-driver", addr=addr) == "vfio-pci"
        # The watcher keeps receiving after the error.
        while True:
            with anyio.move_on_after(0.5):
                await sub.receive()  # drain the backlog of the burst
                continue
            break
        set_driver(tmp_path, devpath, "")
        kick(addr, "change")
        with anyio.fail_after(10):
            while True:
                event = await sub.receive()
                if event.type == "driver-changed":
                    break
        assert event.new == ""


async def test_synthetic_uevents_that_contradict_the_real_tree_change_nothing() -> None:
    """On the real /sys: a synthetic ``remove``, ``add``, ``unbind`` or ``bind`` (with the
    kernel's SYNTH_UUID and SYNTH_ARG_* keys, or without) claims what did not happen; the
    watcher reads the tree, which still holds every device on its driver, so nothing is
    published and the model stays a fresh scan's. A synthetic uevent of a subsystem not
    followed (``mem``) is dropped unread."""
    import gpuwatch

    real_device()  # the same preconditions
    addrs = sorted(os.listdir(REAL_BUS))
    words = ["remove 11111111-2222-3333-4444-555555555555 GONE=1", "add", "unbind",
             "bind 11111111-2222-3333-4444-555555555555 A=1 B=2", "change"]
    async with open_watcher("/", "kernel", reconcile_interval=0, cdi_poll_interval=0) as w:
        before = w.model.functions()
        async with w.subscribe() as sub:
            for addr in addrs:
                for word in words:
                    with open(f"{REAL_BUS}/{addr}/uevent", "w") as fh:
                        fh.write(word)
            if os.access("/sys/class/mem/null/uevent", os.W_OK):
                with open("/sys/class/mem/null/uevent", "w") as fh:
                    fh.write("remove")
            # A marker: the pump has applied everything sent before it once a resync it
            # queues behind the same lock has been published.
            await anyio.sleep(0.5)
            await w.resync("reconcile")
            with anyio.fail_after(10):
                event = await sub.receive()
        assert (event.type, event.reason, event.changes) == ("resync", "reconcile", 0)
        assert w.model.functions() == before == gpuwatch.scan("/").functions()
        assert {f.addr for f in before} == set(addrs)


def test_watch_command_exits_0_on_sigterm(tmp_path: Path) -> None:
    addr, devpath = real_device()
    mirror(tmp_path, addr, devpath, "virtio-pci")
    log = tmp_path / "events.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwatch", "watch", "--root", str(tmp_path), "--source", "kernel",
         "--log", str(log), "--reconcile-interval", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    stderr = ""
    try:
        deadline = time.monotonic() + 30
        while not (log.exists() and log.read_text().endswith("\n")):
            assert time.monotonic() < deadline, "no ready event"
            time.sleep(0.05)
        set_driver(tmp_path, devpath, "vfio-pci")
        kick(addr)
        while '"driver-changed"' not in log.read_text():
            assert time.monotonic() < deadline, "no driver-changed event"
            time.sleep(0.05)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=5)
        assert time.monotonic() - sent < 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    lines = log.read_text().splitlines()
    assert [line.count('"seq"') for line in lines] == [1] * len(lines)
    assert '"type":"ready"' in lines[0]


def test_five_overflows_in_a_row_never_deafen_a_real_daemon(tmp_path: Path) -> None:
    """A real daemon on the default kernel source (whichever implementation that is), a
    tiny receive buffer, and five bursts that overflow it: each ends in one rescan that
    reports what changed and a `resync`, and the next single uevent still reaches a
    subscriber of the socket."""
    from daemon_helpers import Daemon, Lines, connect

    from gpuwatch.service.testing import short_socket_dir

    addr, devpath = real_device()
    root = tmp_path / "root"
    mirror(root, addr, devpath, "virtio-pci")
    with short_socket_dir() as sockdir, Daemon(
        root, tmp_path, f"{sockdir}/gw.sock", "--receive-buffer", "4096", source="auto"
    ) as d, connect(d.sock, timeout=30) as sub:
        assert d.proc is not None
        lines = Lines(sub)
        assert "result" in lines.request("subscribe", {"types": ["resync", "driver-changed"]})
        driver = "virtio-pci"

        def until(pred: Any, what: str) -> dict[str, Any]:
            while True:
                try:
                    event = lines.line()
                except TimeoutError:
                    raise AssertionError(f"no {what}") from None
                if pred(event):
                    return event

        for round_ in range(5):
            # The daemon is busy (stopped) while the burst comes: the buffer must overflow.
            changed = "vfio-pci" if driver != "vfio-pci" else "virtio-pci"
            set_driver(root, devpath, changed)
            os.kill(d.proc.pid, signal.SIGSTOP)
            try:
                for _ in range(200):
                    kick(addr)
            finally:
                os.kill(d.proc.pid, signal.SIGCONT)
            sub.settimeout(30)
            seen: list[dict[str, Any]] = []
            resync = until(lambda e, seen=seen: seen.append(e) or e.get("type") == "resync",
                           "resync")
            assert resync["reason"] == "overflow", (round_, resync)
            # The rescan told what changed while the daemon could not read.
            assert any(e.get("type") == "driver-changed" and e.get("new") == changed
                       for e in seen), (round_, seen)
            driver = changed
            # One more uevent after the rescan: it is heard.
            after = "vfio-pci" if driver != "vfio-pci" else "virtio-pci"
            set_driver(root, devpath, after)
            time.sleep(0.2)  # let the burst's queued tail go before the one that counts
            kick(addr)
            event = until(lambda e, a=after: e.get("type") == "driver-changed"
                          and e.get("new") == a, f"driver-changed to {after}")
            assert event["addr"] == addr
            driver = after
        resyncs = [e for e in d.events() if e["type"] == "resync"]
        assert len(resyncs) >= 5


def test_a_sustained_real_storm_shares_its_rescans(tmp_path: Path) -> None:
    """Two seconds of real uevents into a tiny receive buffer, which overflows again as soon
    as it is drained: a rescan a gap (at most one a second), not one a loss, and one journal
    line each; the change made in the storm is found, and the daemon hears on after it."""
    from daemon_helpers import Daemon

    from gpuwatch.service.testing import short_socket_dir

    addr, devpath = real_device()
    root = tmp_path / "root"
    mirror(root, addr, devpath, "virtio-pci")
    with short_socket_dir() as sockdir:
        d = Daemon(root, tmp_path, f"{sockdir}/gw.sock", "--receive-buffer", "4096",
                   source="auto").start()
        try:
            set_driver(root, devpath, "vfio-pci")
            kicks, began = 0, time.monotonic()
            while time.monotonic() - began < 2.0:
                kick(addr)
                kicks += 1
            deadline = time.monotonic() + 20
            while not any(e["type"] == "driver-changed" and e.get("new") == "vfio-pci"
                          for e in d.events()):
                assert time.monotonic() < deadline, "the storm's change was never found"
                time.sleep(0.05)
            time.sleep(2.5)  # a rescan held for the storm's last losses comes in this time
            set_driver(root, devpath, "")
            kick(addr, "change")
            while not any(e["type"] == "driver-changed" and e.get("new") == "" for e in d.events()):
                assert time.monotonic() < deadline, "deaf after the storm"
                time.sleep(0.05)
        finally:
            d.stop()
    resyncs = [e for e in d.events() if e["type"] == "resync"]
    assert resyncs, "the buffer never overflowed"
    assert all(e["reason"] == "overflow" for e in resyncs)
    assert len(resyncs) <= 6, (len(resyncs), kicks)  # 2 s of storm, a rescan a second
    lost = [line for line in d.stderr.splitlines() if "events lost" in line]
    assert len(lost) == len(resyncs), d.stderr[-2000:]
    assert any("more time(s) since the last rescan" in line for line in lost), lost
