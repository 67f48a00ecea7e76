"""What a long-running daemon holds stays bounded by what the host and its clients hold now,
not by how long it has run.

A real ``gpuwatch watch`` process (tests/daemon_helpers.py) is driven through rounds of
churn: thousands of short connections, subscribers that vanish mid-stream or mid-replay,
slow readers dropped for lag, peers refused at the client limit, uevent storms across many
log rotations. After each round its descriptors (``/proc/PID/fd``) are back to what they
were after the warm-up, its threads no more, and its resident memory grows no further
between the first round and the third than noise allows. In process, a watcher's every
map and set after devices came and went equals a fresh scan's of the final tree, and the
JSON cache of published GPU entries holds one entry per GPU, not one per state each went
through.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from daemon_helpers import Daemon, Lines, connect, probe
from test_fast_paths import tmpfs_root  # noqa: F401 - a fixture
from watch_helpers import watching

from gpuwatch.core import events as events_mod
from gpuwatch.core.state import HostState
from gpuwatch.hostfs.scan import HostPaths, scan
from gpuwatch.model import HostModel
from gpuwatch.service import protocol as P
from gpuwatch.service.testing import short_socket_dir
from gpuwatch.sources.memory import MemorySource
from gpuwatch.testing import SysRoot, example_gpu_host
from gpuwatch.watch.eventlog import read_events
from gpuwatch.watch.watcher import open_watcher

GPU = "0000:01:00.0"
NIC = "0000:02:00.0"
BRIDGE = "0000:00:1c.0"
#: Resident memory the daemon may gain between the end of the first round of churn and the
#: end of the third (allocator noise; a leak of a few hundred bytes per event or per
#: connection is megabytes here).
RSS_NOISE_KIB = 3 * 1024


@pytest.fixture
def sockdir() -> Iterator[str]:
    with short_socket_dir() as path:
        yield path


@dataclass(frozen=True)
class Usage:
    fds: int
    threads: int
    rss_kib: int


def usage(d: Daemon) -> Usage:
    """The daemon's descriptors, threads and resident memory, as /proc tells them."""
    assert d.proc is not None
    status = dict(line.split(":", 1) for line in
                  Path(f"/proc/{d.proc.pid}/status").read_text().splitlines() if ":" in line)
    return Usage(d.fds(), int(status["Threads"]), int(status["VmRSS"].split()[0]))


def settled(d: Daemon, base: Usage, timeout: float = 15) -> Usage:
    """The daemon's usage once it has let go of every descriptor above ``base`` (closes of
    connections it has not seen yet, a replay still ending), or as it is at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        now = usage(d)
        if (now.fds <= base.fds and now.threads <= base.threads) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def rounds(d: Daemon, churn: Callable[[], None]) -> None:
    """Warm up with one round of ``churn``, then three more, each of which must give back
    every descriptor and thread; memory may grow from the first to the third by noise."""
    churn()
    time.sleep(0.2)
    base = usage(d)
    after: list[Usage] = []
    for _ in range(3):
        churn()
        now = settled(d, base)
        assert now.fds == base.fds, (base, now)
        assert now.threads <= base.threads, (base, now)
        after.append(now)
    assert after[2].rss_kib - after[0].rss_kib <= RSS_NOISE_KIB, (base, after)


def toggle(host: SysRoot, d: Daemon, times: int) -> str:
    """Unbind and bind the NVIDIA GPU ``times`` times (each a driver-changed and a
    detect-vfio probe-changed, the largest lines a storm makes); its driver at the end."""
    link = host.device_dir(GPU) / "driver"
    driver = link.resolve().name if link.is_symlink() else ""
    for _ in range(times):
        if driver:
            host.unbind(GPU)
            driver = ""
        else:
            host.bind(GPU, "nvidia")
            driver = "nvidia"
        d.push(host.uevent_props("bind" if driver else "unbind", GPU))
    return driver


def paced(host: SysRoot, d: Daemon, times: int, timeout: float = 30) -> None:
    """`toggle` one at a time, each applied before the next is pushed: every one its own
    batch with its own events (a backlog read at once is one read per device, one pair of
    events), so the events published follow ``times``, however busy the machine."""
    deadline = time.monotonic() + timeout
    with connect(d.sock) as s:
        lines = Lines(s)
        for _ in range(times):
            driver = toggle(host, d, 1)
            while lines.request("probe", {"action": "display-driver", "addr": GPU})[
                    "result"] != driver:
                assert time.monotonic() < deadline, "the daemon did not apply the uevents"
                time.sleep(0.002)


def applied(d: Daemon, driver: str, timeout: float = 20) -> None:
    """Wait until the daemon's model has the GPU on ``driver`` (every uevent pushed before
    the last one applied) and its event count stands still."""
    deadline = time.monotonic() + timeout
    last = -1
    while True:
        assert time.monotonic() < deadline, "the daemon did not apply the uevents in time"
        with connect(d.sock) as s:
            lines = Lines(s)
            answer = lines.request("probe", {"action": "display-driver", "addr": GPU})
            seq = lines.request("subscribe", {"types": ["ready"]}, rid=2)["result"]["seq"]
        if answer.get("result") == driver and seq == last:
            return
        last = seq
        time.sleep(0.1)


# --------------------------------------------------------------------------- the socket


def _short_connections(d: Daemon, cycles: int) -> None:
    """Clients that come and go every way a client can: hang up at once, after half a
    line, after a probe, after shutting their write side, after subscribing, and in the
    middle of a history replay."""
    for _ in range(cycles):
        connect(d.sock).close()
        with connect(d.sock) as s:
            s.sendall(b'{"id": 1, "method": "pro')
        assert "result" in probe(d.sock)
        with connect(d.sock) as s:
            s.sendall(P.encode_request(1, "probe", {"action": "detect-gpu"}))
            s.shutdown(socket.SHUT_WR)
            assert Lines(s).eof()
        with connect(d.sock) as s:
            assert "result" in Lines(s).request("subscribe", {})
        with connect(d.sock) as s:
            s.sendall(P.encode_request(1, "subscribe", {"since_seq": 1}))
            assert s.recv(4096)  # the reply and the replay's first chunk, then gone


@pytest.mark.timeout(90)
def test_thousands_of_short_connections_leave_the_daemon_as_they_found_it(
        host: SysRoot, tmp_path: Path, sockdir: str) -> None:
    with Daemon(host.root, tmp_path, f"{sockdir}/gw.sock") as d:
        paced(host, d, 200)  # a log long enough that a replay is cut off in it
        rounds(d, lambda: _short_connections(d, 300))
    assert d.proc is not None and d.proc.returncode == 0, d.stderr


def _lagging_and_refused(host: SysRoot, d: Daemon, cycles: int) -> None:
    """Subscribers that stop reading while a storm runs (each dropped for lag with a
    ``lagged`` line), then more clients than the daemon serves (the rest refused)."""
    for _ in range(cycles):
        with contextlib.ExitStack() as readers:
            subscribed = [readers.enter_context(connect(d.sock)) for _ in range(4)]
            for s in subscribed:
                assert "result" in Lines(s).request("subscribe", {})
            paced(host, d, 150)  # ~450 KiB each: past what the kernel and the daemon hold
            for s in subscribed:  # each was dropped: what it was sent, `lagged` last, then EOF
                lines = Lines(s)
                assert lines.eof()
                assert P.loads(lines.buf.splitlines()[-1])["type"] == "lagged"
        with contextlib.ExitStack() as held:
            for s in _hold(d, 8):
                held.enter_context(s)
            for _ in range(20):
                with connect(d.sock) as s:
                    try:
                        refusal = Lines(s).line()
                    except (EOFError, ConnectionResetError):
                        continue
                    assert refusal["error"]["code"] == P.TOO_MANY_CLIENTS, refusal
        _until_served(d)


def _hold(d: Daemon, count: int, timeout: float = 10) -> list[socket.socket]:
    """``count`` connections the daemon serves, once it has seen the last ones leave."""
    deadline = time.monotonic() + timeout
    while True:
        held: list[socket.socket] = []
        try:
            for _ in range(count):
                held.append(connect(d.sock))
                if "result" not in Lines(held[-1]).request("probe", {"action": "detect-gpu"}):
                    break
            else:
                return held
        except (EOFError, OSError):
            pass
        for s in held:
            s.close()
        assert time.monotonic() < deadline, "the daemon never had room again"
        time.sleep(0.05)


def _until_served(d: Daemon, timeout: float = 10) -> None:
    """Wait until the daemon has seen the clients that left and serves a new one."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if "result" in probe(d.sock):
                return
        except (EOFError, OSError):
            pass
        assert time.monotonic() < deadline, "the daemon never served again"
        time.sleep(0.02)


@pytest.mark.timeout(90)
def test_slow_readers_dropped_and_peers_refused_leave_nothing_behind(
        host: SysRoot, tmp_path: Path, sockdir: str) -> None:
    with Daemon(host.root, tmp_path, f"{sockdir}/gw.sock", "--socket-max-output-bytes", "4096",
                "--socket-max-clients", "8", "--socket-root-reserve", "0") as d:
        rounds(d, lambda: _lagging_and_refused(host, d, 3))
    assert d.proc is not None and d.proc.returncode == 0, d.stderr


# --------------------------------------------------------------------------- uevents, log


@pytest.mark.timeout(120)
def test_a_uevent_storm_across_many_log_rotations_leaves_the_daemon_bounded(
        host: SysRoot, tmp_path: Path, sockdir: str) -> None:
    """GPU binds and unbinds by the thousand, the log rotated every 64 KiB (hundreds of
    times), a subscriber replaying from the start each round: the rotated files are closed,
    and memory does not follow the number of events published (each detect-vfio change
    used to leave its GPU entries and their JSON in a cache of 4096)."""
    # A follower that reads only its first bytes may leave a client's whole output limit
    # unread in the daemon: kept small, so that what is measured is what the daemon keeps.
    with Daemon(host.root, tmp_path, f"{sockdir}/gw.sock", "--log-max-bytes", "65536",
                "--log-keep", "2", "--socket-max-output-bytes", "65536") as d:
        def churn() -> None:
            with connect(d.sock) as follower:
                follower.sendall(P.encode_request(1, "subscribe", {"since_seq": 1}))
                applied(d, toggle(host, d, 2500))
                assert follower.recv(4096)
        rounds(d, churn)
        rotated = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("events"))
    assert rotated == ["events.jsonl", "events.jsonl.1", "events.jsonl.2", "events.jsonl.lock"]
    assert d.proc is not None and d.proc.returncode == 0, d.stderr


# --------------------------------------------------------------------------- the model


def _maps(obj: object) -> dict[str, Any]:
    """Every dict, set and list an object keeps (a callable's table aside)."""
    return {name: value for name, value in vars(obj).items()
            if isinstance(value, (dict, set, frozenset, list)) and name != "_handlers"}


def _assert_as_fresh(model: HostModel, root: Path) -> None:
    """The watcher's model and the reads it keeps hold exactly what a fresh scan of the
    tree does: no entry for a function, node or failure that is gone. The state's maps are
    equal; the reads kept per directory (`HostPaths`) have the same keys (their values are
    each directory's last full read, which a bind through the plain lane leaves as it was)."""
    paths = HostPaths(root)
    fresh = HostModel(paths, HostState(model.tables, scan(paths, model.tables)))
    for kept, new, by_key in ((model.state, fresh.state, False), (model.paths, paths, True),
                              (model, fresh, False)):
        for name, value in _maps(kept).items():
            other = getattr(new, name)
            if by_key and isinstance(value, dict):
                assert set(value) == set(other), (type(kept).__name__, name)
            else:
                assert value == other, (type(kept).__name__, name)


async def _until(check: Callable[..., object], *args: object) -> None:
    """Wait until ``check(*args)`` holds (the uevents pushed before it applied)."""
    with anyio.fail_after(20):
        while not check(*args):
            await anyio.sleep(0.005)


def _rebind(s: SysRoot, src: MemorySource, addr: str, driver: str) -> None:
    """Unbind ``addr`` and bind it to ``driver``, each with its uevent."""
    s.unbind(addr)
    src.push(s.uevent_props("unbind", addr))
    s.bind(addr, driver)
    src.push(s.uevent_props("bind", addr))


def _module(s: SysRoot, src: MemorySource, name: str, *, loaded: bool) -> None:
    if loaded:
        s.add_module(name)
    else:
        s.remove_module(name)
    src.push({"ACTION": "add" if loaded else "remove", "DEVPATH": f"/module/{name}",
              "SUBSYSTEM": "module"})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["tmp", "tmpfs"])
async def test_devices_that_come_and_go_leave_no_trace_in_the_watcher(
        tmp_path: Path, request: pytest.FixtureRequest, where: str) -> None:
    """Functions hot-plugged at new addresses by the hundred (a NIC or a display function,
    rebound, moved to vfio-pci with a VFIO device, given a DRM node and a framebuffer, back
    on its driver, then removed), virtual DRM nodes, modules loaded and unloaded, an IOMMU
    group moved back and forth, a wedge cleared by a rebind, a bridge's failed recovery
    outlived by a bind below it and then recovered: the watcher keeps what a fresh scan of
    the final tree keeps, and no more after 120 cycles than after 40. The reads kept per
    function directory used to keep an entry for every function ever read (until a
    rescan: never with ``--reconcile-interval 0``), and the wedge and sign-of-life ranks
    outlived the wedge and the failure they ranked."""
    # On tmpfs, as on sysfs, inode numbers name a directory for good: the bind/unbind
    # shortcut keeps each directory's identity and links there too.
    parent = tmp_path if where == "tmp" else request.getfixturevalue("tmpfs_root")
    s = example_gpu_host(parent / "h")
    s.add_bridge("0000:00:1d.0", device="0xa298", iommu_group=20)
    card = s._drm["card1"]
    cycles = 120
    async with watching(s) as (w, src, _got):
        state = w.model.state
        sizes: list[int] = []
        for i in range(cycles):
            addr, drm = f"0000:{0x10 + i:02x}:00.0", f"card{10 + i}"
            own = ("igb", "0x8086", "0x1533", "0x020000") if i % 2 else (
                "nouveau", "0x10de", "0x2204", "0x030000")
            devpath = s.add_function(addr, parent="0000:00:1d.0", driver=own[0], vendor=own[1],
                                     device=own[2], klass=own[3], iommu_group=100 + i)
            src.push(s.uevent_props("add", addr))
            _rebind(s, src, addr, own[0])
            _rebind(s, src, addr, "vfio-pci")
            src.push(s.uevent_props("add", s.add_vfio_dev(addr, i)))
            src.push(s.uevent_props("add", s.add_drm(drm, addr)))
            src.push(s.uevent_props("add", s.add_framebuffer("fb1", addr)))
            virtual = s.add_drm(f"renderD{200 + i}", None)
            src.push(s.uevent_props("add", virtual))
            _module(s, src, f"leak{i}", loaded=True)
            s.set_iommu_group(NIC, 30 + i)
            src.push(s.uevent_props("change", NIC))
            src.push({**s.uevent_props("change", card), "WEDGED": "rebind"})
            src.push({**s.uevent_props("change", BRIDGE), "ERROR_EVENT": "FAILED_RECOVERY",
                      "ONLINE": "0"})
            _rebind(s, src, NIC, "igb")
            _rebind(s, src, GPU, "nvidia")
            await _until(lambda a: a in state.functions and state.alive_marks, addr)
            # ... and all of it goes.
            src.push({**s.uevent_props("change", BRIDGE),
                      "ERROR_EVENT": "SUCCESSFUL_RECOVERY", "ONLINE": "1"})
            _module(s, src, f"leak{i}", loaded=False)
            s.remove_drm(f"renderD{200 + i}")
            src.push(s.uevent_props("remove", virtual))
            src.push(s.uevent_props("remove", s.remove_vfio_dev(addr)))
            _rebind(s, src, addr, own[0])
            await _until(lambda a, d: state.functions[a].driver == d, addr, own[0])
            s.remove_framebuffer("fb1")
            src.push(s.uevent_props("remove", devpath + "/graphics/fb1"))
            gone = s._drm[drm]
            s.remove_drm(drm)
            src.push(s.uevent_props("remove", gone))
            s.remove_function(addr)
            src.push(s.uevent_props("remove", addr))
            s.set_iommu_group(NIC, 14)
            src.push(s.uevent_props("change", NIC))
            await _until(lambda a: a not in state.functions and not state.recovery_marks
                         and state.functions[NIC].iommu_group == 14, addr)
            sizes.append(sum(len(v) for obj in (state, w.model.paths, w.model)
                             for v in _maps(obj).values()))
        # Nothing it keeps grows with the cycles it went through.
        assert sizes[-1] == sizes[cycles // 3 - 1], (sizes[cycles // 3 - 1], sizes[-1])
        _assert_as_fresh(w.model, s.root)


@pytest.mark.timeout(60)
async def test_published_gpu_entries_are_cached_once_per_gpu_not_once_per_change(
        host: SysRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each detect-vfio probe-changed names the GPU's old and new entries; the JSON made
    for a new one is kept for the change that supersedes it. What stays is the last entry
    of each GPU, not every entry of every change (each holding its group's records) until
    4096 of them are cleared at once."""
    monkeypatch.setattr(events_mod, "_GPU_JSON", {})
    src = MemorySource()
    async with open_watcher(host.root, src, reconcile_interval=0, cdi_poll_interval=0,
                            log=tmp_path / "events.jsonl") as w:
        for i in range(300):
            driver = "nvidia" if i % 2 else ""
            if driver:
                host.bind(GPU, driver)
            else:
                host.unbind(GPU)
            src.push(host.uevent_props("bind" if driver else "unbind", GPU))
            # One change at a time, each published on its own, as on a quiet host.
            await _until(lambda d: w.model.state.functions[GPU].driver == d, driver)
        gpus = len(w.model.state.gpu_addrs())
    changes = [e for e in read_events(tmp_path / "events.jsonl")
               if e["type"] == "probe-changed" and e["action"] == "detect-vfio"]
    assert len(changes) >= 300
    assert 0 < len(events_mod._GPU_JSON) <= gpus, len(events_mod._GPU_JSON)
