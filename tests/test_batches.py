"""Batches end to end: each device read once per batch, a backlog applied in slices with
requests and subscribers served between them, one outbox append per socket client per batch.

No timings: every assertion is about counts and order, which a slow machine cannot change.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

import gpuwatch.hostfs.scan as scan_mod
import gpuwatch.watch.watcher as watcher_mod
from gpuwatch.core.uevent import UEvent
from gpuwatch.hostfs.scan import observe_batch
from gpuwatch.service import protocol as P
from gpuwatch.service.server import Connection
from gpuwatch.service.sharedsend import SharedBytes
from gpuwatch.service.testing import served_watcher, short_socket_dir
from gpuwatch.sources.memory import MemorySource
from gpuwatch.testing import SysRoot, synthetic_host
from gpuwatch.watch.watcher import PUMP_SLICE, open_watcher

NV, NV_AUDIO, IGPU, NIC = "0000:01:00.0", "0000:01:00.1", "0000:00:02.0", "0000:02:00.0"


async def settle(source: MemorySource, watcher: Any, seq: int) -> None:
    with anyio.fail_after(10):
        while watcher.seq < seq:
            await anyio.sleep(0.005)


async def test_a_device_named_a_hundred_times_is_read_once_and_converges(
    host: SysRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: Counter[str] = Counter()
    touched: Counter[str] = Counter()  # syscalls on each function's directory

    def counting(paths: Any, tables: Any, batch: Sequence[UEvent], devpaths: Any) -> Any:
        for event in batch:
            reads[event.devpath] += 1
        return observe_batch(paths, tables, batch, devpaths)

    def counted(real: Any) -> Any:
        def call(path: str, *args: Any, **kwargs: Any) -> Any:
            touched[str(path)] += 1
            return real(path, *args, **kwargs)
        return call

    monkeypatch.setattr(watcher_mod, "observe_batch", counting)
    monkeypatch.setattr(scan_mod, "link_name", counted(scan_mod.link_name))
    monkeypatch.setattr(os, "access", counted(os.access))
    monkeypatch.setattr(os, "stat", counted(os.stat))
    source = MemorySource()
    async with open_watcher(host.root, source, reconcile_interval=0, cdi_poll_interval=0) as w:
        async with w.subscribe(types={"driver-changed"}) as sub:
            host.unbind(NIC)
            touched.clear()  # the initial scan read everything
            for i in range(100):  # a flapping link: unbind/bind words, the tree ends unbound
                source.push(host.uevent_props("unbind" if i % 2 else "bind", NIC))
            source.push(host.uevent_props("change", IGPU))
            with anyio.fail_after(5):
                event = await sub.receive()
            assert (event.addr, event.old, event.new) == (NIC, "igb", "")
            with anyio.move_on_after(0.2):
                extra = await sub.receive()
                pytest.fail(f"one change expected, got another: {extra}")
        assert w.probe("display-driver", addr=NIC) == ""
    nic_devpath = host.uevent_props("change", NIC)["DEVPATH"]
    assert reads[nic_devpath] == 1
    # The plain NIC's unbind (the last word) costs at most its driver link: no identity stat.
    nic_dir = str(host.device_dir(NIC))
    assert sum(n for path, n in touched.items() if path.startswith(nic_dir)) <= 2
    assert reads[host.uevent_props("change", IGPU)["DEVPATH"]] == 1


async def test_bind_then_change_for_one_device_is_a_full_read(host: SysRoot) -> None:
    """Mixed words for one device: the read must not trust the cached identity alone."""
    source = MemorySource()
    async with open_watcher(host.root, source, reconcile_interval=0, cdi_poll_interval=0) as w:
        async with w.subscribe(types={"driver-changed"}) as sub:
            host.unbind(NIC)
            source.push(host.uevent_props("unbind", NIC))
            source.push(host.uevent_props("change", NIC))
            with anyio.fail_after(5):
                event = await sub.receive()
        assert event.new == ""


@pytest.fixture
def fast_tmp(tmp_path: Path) -> Iterator[Path]:
    """tmpfs when there is one: building hundreds of functions on a disk times its journal."""
    shm = "/dev/shm"
    if not (os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK)):
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir=shm, prefix="gpuwatch-test-") as path:
        yield Path(path)


async def test_a_burst_that_fits_the_buffer_does_not_lag_a_reader_that_keeps_up(
    fast_tmp: Path,
) -> None:
    """~460 driver changes drained as one source batch; the reader's buffer holds 300."""
    host = synthetic_host(fast_tmp / "host", 600)
    addrs = [a for a in sorted(host.functions) if (host.device_dir(a) / "driver").is_symlink()]
    source = MemorySource()
    async with (
        open_watcher(host.root, source, reconcile_interval=0, cdi_poll_interval=0) as w,
        w.subscribe(types={"driver-changed"}, buffer=PUMP_SLICE + 44) as sub,
    ):
        for addr in addrs:
            host.unbind(addr)
        for addr in addrs:  # pushed before the pump runs: one batch
            source.push(host.uevent_props("unbind", addr))
        got = []
        with anyio.fail_after(20):
            while len(got) < len(addrs):
                got.append(await sub.receive())  # SubscriberLagged would fail the test
    assert len(addrs) > PUMP_SLICE + 44  # the burst is bigger than the buffer
    assert [e.addr for e in got] == addrs
    assert all(e.new == "" for e in got)


async def test_requests_are_answered_between_slices_of_a_backlog(host: SysRoot) -> None:
    applied = 0
    total = 10_000
    with short_socket_dir() as sockdir:
        async with served_watcher(host.root, f"{sockdir}/gw.sock") as served:
            w = served.watcher
            inner = w.apply

            def counting(observations: Any) -> Any:
                nonlocal applied
                applied += 1
                return inner(observations)

            w.apply = counting  # type: ignore[method-assign]
            stream = await anyio.connect_unix(f"{sockdir}/gw.sock")
            async with stream:
                source = served.source
                assert isinstance(source, MemorySource)
                for i in range(total):  # distinct devices: the slices cannot collapse
                    source.push({"ACTION": "change", "SUBSYSTEM": "pci",
                                 "DEVPATH": f"/devices/pci0000:00/0000:{i >> 8:02x}:{i & 31:02x}"
                                            f".{(i >> 5) & 7}"})
                await stream.send(P.encode_request(1, "probe", {"action": "detect-vfio"}))
                buf = b""
                with anyio.fail_after(30):
                    while b"\n" not in buf:
                        buf += await stream.receive()
                answered_after = applied
                reply = json.loads(buf.partition(b"\n")[0])
                with anyio.fail_after(30):
                    while applied < -(-total // PUMP_SLICE):
                        await anyio.sleep(0.01)
    assert reply["id"] == 1 and "result" in reply
    assert answered_after < total // PUMP_SLICE // 2, (answered_after, applied)


async def test_each_socket_subscriber_gets_one_append_per_batch(
    host: SysRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    appends: Counter[int] = Counter()
    real = Connection.deliver

    def counting(self: Connection, data: bytes, first_seq: int, count: int,
                 shared: SharedBytes | None = None) -> None:
        appends[id(self)] += 1
        real(self, data, first_seq, count, shared)

    with short_socket_dir() as sockdir:
        path = f"{sockdir}/gw.sock"
        async with served_watcher(host.root, path) as served:
            source = served.source
            assert isinstance(source, MemorySource)
            clients = []
            for types in (None, ["driver-changed"]):
                stream = await anyio.connect_unix(path)
                params = {} if types is None else {"types": types}
                await stream.send(P.encode_request(1, "subscribe", params))
                buf = b""
                with anyio.fail_after(5):
                    while b"\n" not in buf:
                        buf += await stream.receive()
                clients.append([stream, buf.partition(b"\n")[2]])
            monkeypatch.setattr(Connection, "deliver", counting)
            before = served.watcher.seq
            for addr in (NIC, IGPU, NV):
                host.unbind(addr)
            for addr in (NIC, IGPU, NV):
                source.push(host.uevent_props("unbind", addr))
            with anyio.fail_after(5):
                while served.watcher.seq < before + 3:
                    await anyio.sleep(0.005)
            published = served.watcher.seq - before
            lines: list[list[dict[str, Any]]] = []
            for stream, buf in clients:
                got: list[dict[str, Any]] = []
                with anyio.move_on_after(0.5):
                    while True:
                        while b"\n" in buf:
                            line, _, buf = buf.partition(b"\n")
                            got.append(json.loads(line))
                        buf += await stream.receive()
                lines.append(got)
                await stream.aclose()
    assert sorted(appends.values()) == [1, 1]
    everything, filtered = lines
    assert [e["seq"] for e in everything] == list(range(before + 1, before + published + 1))
    assert [(e["type"], e["addr"]) for e in filtered] == [
        ("driver-changed", NIC), ("driver-changed", IGPU), ("driver-changed", NV)
    ]
