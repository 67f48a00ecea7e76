"""The measuring pieces of ``benchmarks/run.py``, importable so a smoke test can run them small.

The machine this runs on is shared and noisy, so every figure that is compared with another is
measured in the same run, interleaved with it, as a median over many repetitions. Fixture hosts
live on tmpfs when there is one: sysfs is memory-backed, and a disk filesystem would time its
journal (building a 4,096-function tree on ext4 takes 40 s, on tmpfs 2 s).
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

import gpuwatch
from gpuwatch.core.pci import is_gpu_class
from gpuwatch.core.probes import WATCHED_PROBES
from gpuwatch.core.uevent import UEvent
from gpuwatch.hostfs.files import link_name, read_text
from gpuwatch.hostfs.scan import HostPaths, scan_functions
from gpuwatch.model import HostModel
from gpuwatch.service.daemon import freeze_startup_heap
from gpuwatch.sources import SourceUnavailable
from gpuwatch.sources.memory import MemorySource
from gpuwatch.testing import SysRoot, synthetic_host
from gpuwatch.watch.watcher import open_watcher

REPO = Path(__file__).resolve().parents[1]
WRITER = Path(__file__).resolve().with_name("storm_writer.py")

#: The probe actions the issue benchmarks, in its order.
PROBE_ACTIONS = (
    "detect-vfio",
    "detect-host-devices",
    "detect-gpu",
    "detect-amd-gpu",
    "amd-gfx-version",
    "vfio-group-accessible",
)
#: The JSON keys, exactly as issue 5 names them.
KEYS = (
    "probe_cached_ns",
    "probe_fresh_ns",
    "probe_speedup",
    "scan_ms",
    "event_apply_us",
    "storm_events_per_s",
    "storm_lost",
    "kernel_latency_us",
    "rss_mb",
    "peer",
    "ratios",  # issue 13: each figure against its named baseline, same run
)
#: What a function without a driver is bound to when a benchmark toggles it.
HOME_DRIVER = "vfio-pci"
REAL_PCI = "/sys/bus/pci/devices"


@dataclass(frozen=True)
class Settings:
    """How much to measure. `full` and `quick` are the two runs of ``run.py``."""

    sizes: tuple[int, ...] = (64, 1024, 4096)
    probe_n: int = 1024
    storm_n: int = 1024
    storm_events: int = 20_000
    storm_runs: int = 5  # the median storm is reported
    scan_reps: dict[int, int] = field(default_factory=dict)  # N → repetitions (default below)
    probe_rounds: int = 25  # fresh/cached pairs per action
    cached_batches: int = 5  # cached batches per pair
    cached_loops: int = 2000  # calls per cached batch
    event_samples: int = 5000  # per size
    event_warmup: int = 500
    kernel_samples: int = 2000
    peer_reps: int = 1000
    peer_cached_loops: int = 2000
    rss: bool = True
    kernel: bool = True
    ratios: bool = True  # the ratio rows of benchmarks/ratios.py
    ratio_toggles: int = 1000
    ratio_kernel_rounds: int = 30
    ratio_cli_reps: int = 15
    ratio_trips: int = 500
    ratio_fanout_events: int = 4096
    ratio_fanout_pairs: int = 7  # 100 ÷ 1 pairs; the median pair is reported
    ratio_replay_mib: int = 384  # benchmarks/replay.py: the log one client replays (0: skip)
    ratio_replay_probes: int = 1000  # probe round trips per phase and round (3 rounds)
    ratio_replay_rounds: int = 3

    def scan_reps_for(self, n: int) -> int:
        return self.scan_reps.get(n, 25 if n <= 1024 else 11)


FULL = Settings()
QUICK = Settings(
    ratio_toggles=200,
    ratio_kernel_rounds=8,
    ratio_cli_reps=3,
    ratio_trips=100,
    ratio_fanout_events=2048,
    ratio_fanout_pairs=3,
    ratio_replay_mib=96,
    ratio_replay_probes=500,
    ratio_replay_rounds=2,
    scan_reps={64: 7, 1024: 5, 4096: 3},
    probe_rounds=5,
    cached_batches=3,
    cached_loops=1000,
    storm_runs=1,
    event_samples=1000,
    event_warmup=100,
    kernel_samples=500,
    peer_reps=100,
    peer_cached_loops=500,
)


# --------------------------------------------------------------------------- small helpers


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: a value that was really observed, never an interpolation."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return float(ordered[rank - 1])


def fixture_dir() -> str | None:
    """tmpfs when writable (see the module docstring), else the default temp dir."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return None


@contextlib.contextmanager
def temp_dir(tag: str) -> Iterator[str]:
    path = tempfile.mkdtemp(prefix=f"gpuwatch-bench-{tag}-", dir=fixture_dir())
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def synthetic(n: int) -> Iterator[SysRoot]:
    with temp_dir(str(n)) as path:
        yield synthetic_host(path, n)


def subprocess_env() -> dict[str, str]:
    """The environment for ``python -m gpuwatch``: this checkout first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def current_driver(host: SysRoot, addr: str) -> str:
    return link_name(str(host.device_dir(addr)) + "/driver")


# --------------------------------------------------------------------------- scan and probes


def measure_scans(roots: dict[int, str], s: Settings) -> dict[int, float]:
    """Median ms of ``gpuwatch.scan(root)`` (the whole initial model, as a caller builds it)
    per size, the sizes interleaved so that "linear in N" compares like with like."""
    times: dict[int, list[float]] = {n: [] for n in roots}
    for rep in range(max(s.scan_reps_for(n) for n in roots)):
        for n, root in roots.items():
            if rep < s.scan_reps_for(n):
                t0 = time.perf_counter_ns()
                gpuwatch.scan(root)
                times[n].append((time.perf_counter_ns() - t0) / 1e6)
    return {n: median(t) for n, t in times.items()}


def vfio_group(model: HostModel) -> int:
    """A group with a ``/dev/vfio`` node, so the access probe has a real answer to give."""
    groups = sorted(
        int(p.rsplit("/", 1)[1]) for p in model.state.nodes if p.rsplit("/", 1)[1].isdigit()
        and p.startswith("/dev/vfio/")
    )
    return groups[0] if groups else 0


def _cached_batch(model: HostModel, action: str, group: int | None, loops: int) -> float:
    """ns per call of ``model.probe``, loop overhead included (a pessimistic figure)."""
    probe = model.probe
    if group is None:
        t0 = time.perf_counter_ns()
        for _ in range(loops):
            probe(action)
        t1 = time.perf_counter_ns()
    else:
        t0 = time.perf_counter_ns()
        for _ in range(loops):
            probe(action, group=group)
        t1 = time.perf_counter_ns()
    return (t1 - t0) / loops


def measure_probes(root: str, s: Settings) -> dict[str, dict[str, float]]:
    """Cached and fresh answers of each action, interleaved pair by pair; speedup per pair."""
    model = gpuwatch.scan(root)
    group = vfio_group(model)
    cached: dict[str, list[float]] = {a: [] for a in PROBE_ACTIONS}
    fresh: dict[str, list[float]] = {a: [] for a in PROBE_ACTIONS}
    ratios: dict[str, list[float]] = {a: [] for a in PROBE_ACTIONS}
    for action in PROBE_ACTIONS:  # warm both paths once
        g = group if action == "vfio-group-accessible" else None
        assert model.probe(action, group=g) == gpuwatch.probe(action, root, group=g)
        _cached_batch(model, action, g, s.cached_loops)
    for _ in range(s.probe_rounds):
        for action in PROBE_ACTIONS:
            g = group if action == "vfio-group-accessible" else None
            batch = [_cached_batch(model, action, g, s.cached_loops)
                     for _ in range(s.cached_batches)]
            t0 = time.perf_counter_ns()
            gpuwatch.probe(action, root, group=g)
            f = float(time.perf_counter_ns() - t0)
            cached[action].extend(batch)
            fresh[action].append(f)
            ratios[action].append(f / median(batch))
    return {
        "probe_cached_ns": {a: round(median(cached[a]), 1) for a in PROBE_ACTIONS},
        "probe_fresh_ns": {a: round(median(fresh[a])) for a in PROBE_ACTIONS},
        "probe_speedup": {a: round(median(ratios[a])) for a in PROBE_ACTIONS},
    }


# --------------------------------------------------------------------------- per-event cost


def toggle_plan(model: HostModel, per_kind: int = 16) -> list[str]:
    """GPUs and other endpoints, alternating: a GPU change also rebuilds ``detect-vfio``, the
    costliest answer, so half the samples take that path."""
    fns = model.functions()
    gpus = [f.addr for f in fns if is_gpu_class(f.class_)]
    others = [f.addr for f in fns if not is_gpu_class(f.class_) and not f.class_.startswith("0x06")]

    def spread(items: list[str]) -> list[str]:
        if len(items) <= per_kind:
            return items
        step = len(items) / per_kind
        return [items[int(i * step)] for i in range(per_kind)]

    a, b = spread(gpus), spread(others)
    plan = [x for pair in zip(a, b, strict=False) for x in pair]
    plan += a[len(b):] + b[len(a):]
    return plan


def toggle(host: SysRoot, addr: str, home: dict[str, str]) -> str:
    """Bind an unbound function to its home driver or unbind a bound one; the uevent action."""
    if current_driver(host, addr):
        host.unbind(addr)
        return "unbind"
    host.bind(addr, home[addr])
    return "bind"


@dataclass
class _Rig:
    """One host's watcher, fed by hand, with a subscriber for driver changes."""

    host: SysRoot
    source: MemorySource
    sub: Any
    plan: list[str]
    home: dict[str, str]
    times: list[float] = field(default_factory=list)


async def _sample(rig: _Rig, i: int, keep: bool) -> None:
    addr = rig.plan[i % len(rig.plan)]
    action = toggle(rig.host, addr, rig.home)  # the kernel's part: not timed
    event = UEvent.from_properties(rig.host.uevent_props(action, addr))
    t0 = time.perf_counter_ns()
    rig.source.push(event)
    got = await rig.sub.receive()
    t1 = time.perf_counter_ns()
    if got.addr != addr:
        raise AssertionError(f"expected a driver change of {addr}, got {got!r}")
    if keep:
        rig.times.append((t1 - t0) / 1e3)


async def _event_apply(hosts: Sequence[SysRoot], samples: int, warmup: int) -> list[list[float]]:
    """One watcher per host in one event loop, sampled round-robin (the starting host rotates),
    so every size is measured under the same load, heap and moment."""
    async with contextlib.AsyncExitStack() as stack:
        rigs: list[_Rig] = []
        for host in hosts:
            source = MemorySource()
            w = await stack.enter_async_context(
                open_watcher(host.root, source, reconcile_interval=0, cdi_poll_interval=0))
            sub = await stack.enter_async_context(w.subscribe(types=["driver-changed"]))
            plan = toggle_plan(w.model)
            home = {a: current_driver(host, a) or HOME_DRIVER for a in plan}
            rigs.append(_Rig(host, source, sub, plan, home))
        for i in range(warmup + samples):
            for k in range(len(rigs)):
                await _sample(rigs[(i + k) % len(rigs)], i, keep=i >= warmup)
        return [rig.times for rig in rigs]


def measure_event_apply(hosts: Sequence[SysRoot], s: Settings) -> list[dict[str, float]]:
    """µs from pushing one bind/unbind uevent to the subscriber holding its driver-changed,
    for each host, interleaved."""
    per_host = anyio.run(_event_apply, hosts, s.event_samples, s.event_warmup)
    return [{"p50": round(percentile(t, 50), 1), "p99": round(percentile(t, 99), 1)}
            for t in per_host]


# --------------------------------------------------------------------------- storm


def _storm_plan(host: SysRoot, work: str, events: int) -> dict[str, Any]:
    """Everything the writer process needs to toggle every function of ``host`` in turn."""
    drivers = os.path.join(str(host.root), "sys/bus/pci/drivers")
    fns = []
    for addr in host.functions:
        devdir = str(host.device_dir(addr))
        driver = current_driver(host, addr)
        home = driver or HOME_DRIVER
        driver_dir = str(host.add_driver(home))  # exists already unless nothing used it
        base = host.uevent_props("change", addr, SEQNUM="0")
        props = {k: v for k, v in base.items() if k not in ("ACTION", "DRIVER", "SEQNUM")}
        uevent = read_text(devdir + "/uevent") or ""
        unbound = "".join(f"{ln}\n" for ln in uevent.splitlines() if not ln.startswith("DRIVER="))
        fns.append({
            "addr": addr,
            "devdir": devdir,
            "driver_dir": driver_dir,
            "driver_target": os.path.relpath(driver_dir, devdir),
            "back_target": os.path.relpath(devdir, driver_dir),
            "uevent_bound": f"DRIVER={home}\n{unbound}",
            "uevent_unbound": unbound,
            "bound": bool(driver),
            "props": props,
        })
    assert os.path.isdir(drivers)
    return {
        "fifo": os.path.join(work, "uevents.fifo"),
        "log": os.path.join(work, "events.jsonl"),
        "events": events,
        "chunk": min(64, len(fns)),  # a chunk never toggles one function twice
        "pipe_size": 1 << 20,
        "stall_s": 10.0,
        "poll_s": 0.001,  # how often a waiting writer looks at the log: rarely, it shares a CPU
        "functions": fns,
    }


def model_equals_scan(model: HostModel, root: str) -> bool:
    """The watched model against a fresh scan of the same tree: functions and every answer."""
    fresh = gpuwatch.scan(root, model.tables)
    if model.functions() != fresh.functions():
        return False
    if model.state.nodes != fresh.state.nodes:
        return False
    return all(model.probe(a) == fresh.probe(a) for a in WATCHED_PROBES)


@dataclass(frozen=True)
class StormRun:
    """One storm: its rate, its count, and who spent the CPU (watcher vs the writer)."""

    events: int
    seen: int  # driver-changed events the writer saw logged before it stopped the clock
    produced: int
    seconds: float
    model_equals_fresh_scan: bool
    watcher_cpu_s: float
    writer_cpu_s: float

    @property
    def rate(self) -> float:
        return self.seen / self.seconds if self.seconds > 0 else 0.0


async def _storm(host: SysRoot, plan: dict[str, Any], plan_path: str,
                 reader: list[str] | None = None) -> tuple[dict[str, Any], bool, float]:
    with subprocess.Popen([sys.executable, str(WRITER), plan_path], stdout=subprocess.PIPE,
                          text=True) as writer:
        try:
            if reader is not None:  # the baseline reader instead of gpuwatch
                done = await anyio.run_process([*reader, str(host.root), plan["fifo"],
                                                plan["log"]], check=False)
                out, _ = await anyio.to_thread.run_sync(writer.communicate)
                report: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
                return report, done.returncode == 0, 0.0
            async with open_watcher(host.root, "file:" + plan["fifo"], log=plan["log"],
                                    reconcile_interval=0, cdi_poll_interval=0) as w:
                # As `gpuwatch watch` does once started: what start-up built (here, the
                # benchmark's own figures too) is kept out of the storm's collections.
                freeze_startup_heap()
                try:
                    cpu0 = time.process_time()
                    with anyio.fail_after(600):
                        await w.source_ended.wait()
                    cpu = time.process_time() - cpu0
                finally:
                    gc.unfreeze()
                # Compared once the writer is done: it brings the uevent files and the
                # drivers' back links to their final state after closing the FIFO, and a
                # fresh scan reads a function's uevent where its driver link is absent.
                out, _ = await anyio.to_thread.run_sync(writer.communicate)
                equal = model_equals_scan(w.model, str(host.root))
        finally:
            if writer.poll() is None:
                writer.kill()
                writer.wait()
    report = json.loads(out.strip().splitlines()[-1])
    return report, equal, cpu


def run_storm(host: SysRoot, events: int, reader: list[str] | None = None) -> StormRun:
    """``events`` bind/unbind uevents over every function of ``host`` through a ``file:`` FIFO,
    end to end into the log (see storm_writer.py for why each must produce one event)."""
    with temp_dir("storm") as work:
        plan = _storm_plan(host, work, events)
        os.mkfifo(plan["fifo"])
        plan_path = os.path.join(work, "plan.json")
        with open(plan_path, "w", encoding="utf-8") as fh:
            json.dump(plan, fh)
        report, equal, watcher_cpu = anyio.run(_storm, host, plan, plan_path, reader)
        if "error" in report:
            raise RuntimeError(f"storm writer: {report['error']}")
        produced = 0
        with open(plan["log"], "rb") as fh:
            for line in fh:
                produced += b'"type":"driver-changed"' in line
    return StormRun(
        events=events,
        seen=report["seen"],
        produced=produced,
        seconds=report["t_done"] - report["t_first"],
        model_equals_fresh_scan=equal,
        watcher_cpu_s=watcher_cpu,
        writer_cpu_s=report["cpu_s"],
    )


def measure_storm(host: SysRoot, events: int, runs: int,
                  notes: dict[str, Any] | None = None) -> tuple[float, dict[str, Any]]:
    """Median rate over ``runs`` storms, and the storm_lost record summed over all of them."""
    storms = [run_storm(host, events) for _ in range(runs)]
    expected = sum(r.events for r in storms)
    produced = sum(r.produced for r in storms)
    if notes is not None:
        best = max(storms, key=lambda r: r.rate)
        notes["storm_runs"] = [round(r.rate) for r in storms]
        notes["storm_watcher_cpu_us_per_event"] = round(
            median([r.watcher_cpu_s / r.events * 1e6 for r in storms]), 1)
        notes["storm_writer_cpu_us_per_event"] = round(
            median([r.writer_cpu_s / r.events * 1e6 for r in storms]), 1)
        notes["storm_best"] = round(best.rate)
    lost = {
        "expected": expected,
        "produced": produced,
        "lost": expected - produced,
        "model_equals_fresh_scan": all(r.model_equals_fresh_scan for r in storms),
    }
    return round(median([r.rate for r in storms])), lost


# --------------------------------------------------------------------------- real kernel


def real_device() -> tuple[str, str] | None:
    """(addr, DEVPATH) of the first real PCI device whose ``uevent`` we may write, else None."""
    if os.geteuid() != 0:
        return None
    try:
        addrs = sorted(os.listdir(REAL_PCI))
    except OSError:
        return None
    for addr in addrs:
        if os.access(f"{REAL_PCI}/{addr}/uevent", os.W_OK):
            return addr, os.path.realpath(f"{REAL_PCI}/{addr}")[len("/sys"):]
    return None


def mirror_device(root: str, addr: str, devpath: str) -> SysRoot:
    """A fixture holding the real device at its real DEVPATH (bridges above it included)."""
    host = SysRoot(root)
    parts = devpath.strip("/").split("/")  # devices, pciDDDD:BB, [bridge…], addr
    parent = parts[1]
    real = f"{REAL_PCI}/{addr}"
    for bridge in parts[2:-1]:
        host.add_bridge(bridge, parent=parent if parent != parts[1] else None,
                        domain_root=parts[1])
        parent = bridge
    host.add_function(
        addr,
        vendor=read_text(real + "/vendor") or "0x0000",
        device=read_text(real + "/device") or "0x0000",
        klass=read_text(real + "/class") or "0x000000",
        parent=parent,
    )
    if host.devpath(addr) != devpath:
        raise RuntimeError(f"mirror of {addr} sits at {host.devpath(addr)}, not {devpath}")
    return host


async def _kernel_latency(host: SysRoot, addr: str, samples: int) -> list[float]:
    times: list[float] = []
    home = {addr: HOME_DRIVER}
    uevent = f"{REAL_PCI}/{addr}/uevent"
    async with open_watcher(host.root, "kernel", reconcile_interval=0, cdi_poll_interval=0) as w, \
            w.subscribe(types=["driver-changed"], addrs=[addr]) as sub:
        for _ in range(samples):
            toggle(host, addr, home)  # the fixture changes, then the real kernel says "look"
            fd = os.open(uevent, os.O_WRONLY)
            try:
                t0 = time.perf_counter_ns()
                os.write(fd, b"change")  # the one write to the real /sys this suite makes
                with anyio.fail_after(2):
                    await sub.receive()
                t1 = time.perf_counter_ns()
            finally:
                os.close(fd)
            times.append((t1 - t0) / 1e3)
    return times


def measure_kernel_latency(samples: int) -> dict[str, float] | None:
    """µs from a synthetic uevent written into a real device to the subscriber holding the
    change its fixture shows; None without a writable real PCI device or a kernel socket."""
    found = real_device()
    if found is None:
        return None
    addr, devpath = found
    with temp_dir("kernel") as root:
        try:
            host = mirror_device(root, addr, devpath)
            times = anyio.run(_kernel_latency, host, addr, samples)
        except (OSError, SourceUnavailable, TimeoutError) as exc:
            print(f"kernel latency: not measured ({exc})", file=sys.stderr)
            return None
    return {"p50": round(percentile(times, 50), 1), "p99": round(percentile(times, 99), 1)}


# --------------------------------------------------------------------------- memory


def vm_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def measure_rss(root: str) -> float:
    """MiB resident in a ``gpuwatch watch`` process holding ``root``, once it logged ready."""
    with temp_dir("rss") as work:
        fifo = os.path.join(work, "idle.fifo")
        log = os.path.join(work, "events.jsonl")
        os.mkfifo(fifo)  # a source nobody writes: the watcher sits idle, holding the model
        err_path = os.path.join(work, "stderr.txt")
        with open(err_path, "wb") as err, subprocess.Popen(
            [sys.executable, "-m", "gpuwatch", "watch", "--root", root, "--source", "file:" + fifo,
             "--log", log, "--reconcile-interval", "0"],
            env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=err,
        ) as proc:
            try:
                deadline = time.monotonic() + 120
                while not (os.path.exists(log) and b'"type":"ready"' in Path(log).read_bytes()):
                    if proc.poll() is not None:
                        why = Path(err_path).read_text(errors="replace").strip()
                        raise RuntimeError(f"gpuwatch watch exited {proc.returncode}: {why}")
                    if time.monotonic() > deadline:
                        raise RuntimeError("gpuwatch watch never became ready")
                    time.sleep(0.02)
                time.sleep(0.3)  # let the start-up settle (thread pool, first poll)
                return round(vm_rss_mb(proc.pid), 1)
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


# --------------------------------------------------------------------------- peer: pyudev


def _pyudev_functions(context: Any) -> list[tuple[str, str, str, str, str, str]]:
    """What a pyudev user writes to list PCI functions with ids, driver and IOMMU group."""
    out = []
    for dev in context.list_devices(subsystem="pci"):
        attrs = dev.attributes
        try:
            group = os.path.basename(os.readlink(dev.sys_path + "/iommu_group"))
        except OSError:
            group = ""
        out.append((dev.sys_name, attrs.asstring("vendor"), attrs.asstring("device"),
                    attrs.asstring("class"), dev.driver or "", group))
    return out


def measure_peer(s: Settings, root: str = "/", notes: dict[str, Any] | None = None
                 ) -> dict[str, float]:
    """Median µs to enumerate every PCI function of the real /sys with vendor, device, class,
    driver and IOMMU group: pyudev; ``gpuwatch.scan`` (the whole model, DRM, modules and /dev
    nodes included, so more work than pyudev does); and the cached model's list."""
    import pyudev

    context = pyudev.Context()  # made once: a pyudev user keeps theirs
    paths = HostPaths(root)
    model = gpuwatch.scan(root)
    expect = {(f.addr, f.driver, f.iommu_group) for f in model.functions()}
    got = {(a, d, int(g) if g else -1) for a, _, _, _, d, g in _pyudev_functions(context)}
    if got != expect:
        raise RuntimeError(f"pyudev and gpuwatch disagree about the PCI bus: {got ^ expect}")
    pyudev_t: list[float] = []
    fresh_t: list[float] = []
    pci_t: list[float] = []
    cached_t: list[float] = []
    functions = model.functions
    for _ in range(s.peer_reps):
        t0 = time.perf_counter_ns()
        _pyudev_functions(context)
        t1 = time.perf_counter_ns()
        gpuwatch.scan(root).functions()
        t2 = time.perf_counter_ns()
        for _ in range(s.peer_cached_loops):
            functions()
        t3 = time.perf_counter_ns()
        scan_functions(paths)
        t4 = time.perf_counter_ns()
        pyudev_t.append((t1 - t0) / 1e3)
        fresh_t.append((t2 - t1) / 1e3)
        cached_t.append((t3 - t2) / 1e3 / s.peer_cached_loops)
        pci_t.append((t4 - t3) / 1e3)
    if notes is not None:
        notes["peer_functions"] = len(expect)
        notes["peer_fresh_pci_only_us"] = round(median(pci_t), 2)
    return {
        "pyudev": round(median(pyudev_t), 2),
        "fresh": round(median(fresh_t), 2),
        "cached": round(median(cached_t), 3),
    }


# --------------------------------------------------------------------------- everything


def run_all(s: Settings, progress: Callable[[str], None] = lambda msg: None,
            notes: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every figure of issue 5 under its key (see KEYS); ``notes`` collects the figures that
    explain them (CPU per storm event, each storm's rate, the PCI-only real-/sys scan).

    Every host is built first and kept, so that figures compared across sizes are measured
    interleaved. The storm goes last: it toggles drivers behind the SysRoot's back.
    """
    results: dict[str, Any] = {}
    sizes = sorted(set(s.sizes) | {s.probe_n, s.storm_n})
    with contextlib.ExitStack() as stack:
        hosts: dict[int, SysRoot] = {}
        keep: dict[int, contextlib.ExitStack] = {}
        for n in sizes:
            progress(f"N={n}: building the fixture")
            keep[n] = stack.enter_context(contextlib.ExitStack())
            hosts[n] = keep[n].enter_context(synthetic(n))
        progress(f"initial scan, N={', '.join(map(str, s.sizes))}")
        results["scan_ms"] = {str(n): round(ms, 2) for n, ms in measure_scans(
            {n: str(hosts[n].root) for n in s.sizes}, s).items()}
        progress(f"N={s.probe_n}: probes, cached and fresh")
        results.update(measure_probes(str(hosts[s.probe_n].root), s))
        if s.rss:
            results["rss_mb"] = {}
            for n in s.sizes:
                progress(f"N={n}: resident memory of a watcher")
                results["rss_mb"][str(n)] = measure_rss(str(hosts[n].root))
        else:
            results["rss_mb"] = None
        progress(f"per-event cost, N={', '.join(map(str, s.sizes))}")
        figures = measure_event_apply([hosts[n] for n in s.sizes], s)
        results["event_apply_us"] = {str(n): f for n, f in zip(s.sizes, figures, strict=True)}
        if s.ratios:
            from benchmarks.ratios import run_ratios

            results["ratios"] = run_ratios(s, hosts[s.sizes[0]], hosts[s.sizes[-1]],
                                           hosts[s.storm_n], progress)
        for n in sizes:  # the storm's process should hold what a watcher holds, no more
            if n != s.storm_n:
                keep[n].close()
                del hosts[n]
        gc.collect()
        progress(f"N={s.storm_n}: {s.storm_runs} storm(s) of {s.storm_events:,} uevents")
        rate, lost = measure_storm(hosts[s.storm_n], s.storm_events, s.storm_runs, notes)
        results["storm_events_per_s"] = rate
        results["storm_lost"] = lost
    progress("real kernel: synthetic uevent latency")
    results["kernel_latency_us"] = measure_kernel_latency(s.kernel_samples) if s.kernel else None
    progress("real /sys: pyudev against gpuwatch")
    try:
        results["peer"] = measure_peer(s, notes=notes)
    except (ImportError, OSError) as exc:  # pyudev without a loadable libudev
        print(f"peer: not measured ({exc})", file=sys.stderr)
        results["peer"] = None
    return {key: results.get(key) for key in KEYS}


# --------------------------------------------------------------------------- the table


def machine() -> dict[str, str]:
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpus": str(os.cpu_count()),
        "cpu": cpu,
        "python": sys.version.split()[0],
        "fixtures": fixture_dir() or tempfile.gettempdir(),
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 10 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def format_table(r: dict[str, Any], notes: dict[str, Any] | None = None) -> str:
    """The figures as a readable table (the one docs/performance.md records)."""
    notes = notes or {}
    rows: list[tuple[str, str, str]] = []
    cached, fresh, speed = r["probe_cached_ns"], r["probe_fresh_ns"], r["probe_speedup"]
    for action in PROBE_ACTIONS:
        target = "≤ 2,000 ns" if action in ("detect-vfio", "detect-host-devices") else "≤ 1,000 ns"
        rows.append((f"probe {action}: cached", f"{_fmt(cached[action])} ns", target))
        rows.append((f"probe {action}: fresh", f"{fresh[action] / 1e6:,.1f} ms", ""))
        rows.append((f"probe {action}: speedup", f"{_fmt(speed[action])}x",
                     "≥ 1,000x" if action == "detect-vfio" else ""))
    for n, ms in r["scan_ms"].items():
        rows.append((f"initial scan, N={n}", f"{_fmt(ms)} ms", "≤ 100 ms" if n == "1024" else ""))
    sizes = list(r["event_apply_us"])
    for n in sizes:
        e = r["event_apply_us"][n]
        target = f"p50 ≤ 1.5 x N={sizes[0]}" if n == sizes[-1] and len(sizes) > 1 else ""
        rows.append((f"event apply, N={n}", f"p50 {_fmt(e['p50'])} µs, p99 {_fmt(e['p99'])} µs",
                     target))
    if len(sizes) > 1:
        ratio = r["event_apply_us"][sizes[-1]]["p50"] / r["event_apply_us"][sizes[0]]["p50"]
        rows.append((f"event apply p50, N={sizes[-1]} / N={sizes[0]}", f"{ratio:.2f}x", "≤ 1.5x"))
    rows.append(("storm", f"{_fmt(r['storm_events_per_s'])} events/s", "≥ 20,000/s"))
    if "storm_runs" in notes:
        runs = ", ".join(f"{x:,}" for x in notes["storm_runs"])
        rows.append(("  each storm", f"{runs} events/s", "median reported"))
        cpu = notes["storm_watcher_cpu_us_per_event"]
        rows.append(("  CPU per storm event: watcher", f"{_fmt(cpu)} µs",
                     f"a core of its own: {1e6 / cpu:,.0f}/s" if cpu else ""))
        rows.append(("  CPU per storm event: writer (the fake kernel)",
                     f"{_fmt(notes['storm_writer_cpu_us_per_event'])} µs", ""))
    lost = r["storm_lost"]
    rows.append(("storm lost", f"{lost['lost']} of {lost['expected']:,}; model = fresh scan: "
                 f"{'yes' if lost['model_equals_fresh_scan'] else 'NO'}", "0; yes"))
    k = r["kernel_latency_us"]
    rows.append(("real-kernel uevent latency",
                 "n/a (no writable PCI device)" if k is None
                 else f"p50 {_fmt(k['p50'])} µs, p99 {_fmt(k['p99'])} µs", "p99 ≤ 2,000 µs"))
    for n, mb in (r["rss_mb"] or {}).items():
        rows.append((f"watcher RSS, N={n}", f"{_fmt(mb)} MiB", "≤ 60 MiB" if n == "4096" else ""))
    p = r["peer"] or {"pyudev": None, "fresh": None, "cached": None}
    rows.append(("real /sys: pyudev", f"{_fmt(p['pyudev'])} µs", ""))
    rows.append(("real /sys: gpuwatch fresh (whole scan)", f"{_fmt(p['fresh'])} µs", "≤ pyudev"))
    if "peer_fresh_pci_only_us" in notes:
        rows.append(("  of which the PCI bus alone", f"{_fmt(notes['peer_fresh_pci_only_us'])} µs",
                     f"{notes['peer_functions']} functions"))
    rows.append(("real /sys: gpuwatch cached", f"{_fmt(p['cached'])} µs",
                 "≥ 100x faster than pyudev"))
    if p["pyudev"] and p["cached"]:
        rows.append(("  pyudev / cached", f"{p['pyudev'] / p['cached']:,.0f}x", "≥ 100x"))
    if r.get("ratios"):
        from benchmarks.ratios import format_ratio_rows

        rows.append(("ratios against a baseline of the same run (issue 13)", "", ""))
        rows += [("  " + a, b, c) for a, b, c in format_ratio_rows(r["ratios"])]
    w0 = max(len(a) for a, _, _ in rows)
    w1 = max(len(b) for _, b, _ in rows)
    lines = [f"{'figure':<{w0}}  {'value':>{w1}}  target", "-" * (w0 + w1 + 20)]
    lines += [f"{a:<{w0}}  {b:>{w1}}  {c}".rstrip() for a, b, c in rows]
    return "\n".join(lines)
