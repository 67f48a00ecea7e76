"""The ratio rows of ``benchmarks/run.py``: each figure against its named baseline, both
measured in the same run, interleaved, as medians (the machine is shared and noisy, so only
ratios taken side by side mean anything).

Baselines: an empty method call; a raw ``NETLINK_KOBJECT_UEVENT`` socket that only receives
and splits; a bare interpreter start; a minimal asyncio NDJSON server; a minimal stdlib storm
reader (``storm_reader.py``: parse each uevent, read the driver link, log one line; by
default a write per chunk, with ``--per-line`` a write per line).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio

import gpuwatch
from benchmarks.harness import (
    HOME_DRIVER,
    PROBE_ACTIONS,
    REAL_PCI,
    Settings,
    current_driver,
    median,
    mirror_device,
    real_device,
    subprocess_env,
    temp_dir,
    toggle,
    vfio_group,
)
from benchmarks.replay import measure_replay
from gpuwatch.core.uevent_facts import uevent_facts
from gpuwatch.service.daemon import freeze_startup_heap
from gpuwatch.service.testing import served_watcher, short_socket_dir
from gpuwatch.sources.kernel import NETLINK_KOBJECT_UEVENT, KernelSource
from gpuwatch.sources.memory import MemorySource
from gpuwatch.testing import SysRoot
from gpuwatch.watch.watcher import PUMP_SLICE, Watcher, open_watcher

HERE = Path(__file__).resolve().parent
NDJSON_SERVER = HERE / "ndjson_server.py"
STORM_READER = HERE / "storm_reader.py"


class _Empty:
    def probe(self, action: str, *, group: int | None = None, addr: str | None = None,
              mode: str | None = None, vendor: str | None = None) -> None:
        return None


def _loop_ns(call: Callable[[], object], loops: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(loops):
        call()
    return (time.perf_counter_ns() - t0) / loops


def measure_probe_vs_empty(root: str, s: Settings) -> dict[str, float]:
    """Cached probe ÷ an empty method call of the same signature, per action, interleaved."""
    model = gpuwatch.scan(root)
    group = vfio_group(model)
    empty = _Empty()
    ratios: dict[str, list[float]] = {a: [] for a in PROBE_ACTIONS}
    loops = s.cached_loops
    for _ in range(max(3, s.probe_rounds)):
        for action in PROBE_ACTIONS:
            g = group if action == "vfio-group-accessible" else None
            e = _loop_ns(functools.partial(empty.probe, action, group=g), loops)
            p = _loop_ns(functools.partial(model.probe, action, group=g), loops)
            ratios[action].append(p / e)
    return {a: round(median(r), 2) for a, r in ratios.items()}


# --------------------------------------------------------------------------- log-on toggles


async def _toggle_with_log(hosts: list[SysRoot], samples: int, work: str) -> list[list[float]]:
    async with contextlib.AsyncExitStack() as stack:
        rigs: list[tuple[SysRoot, MemorySource, Any, list[str], dict[str, str], list[float]]] = []
        for i, host in enumerate(hosts):
            source = MemorySource()
            w = await stack.enter_async_context(open_watcher(
                host.root, source, log=os.path.join(work, f"log{i}.jsonl"),
                reconcile_interval=0, cdi_poll_interval=0))
            sub = await stack.enter_async_context(w.subscribe(types=["driver-changed"]))
            gpus = [f.addr for f in w.model.functions() if f.class_.startswith("0x03")]
            home = {a: current_driver(host, a) or HOME_DRIVER for a in gpus}
            rigs.append((host, source, sub, gpus, home, []))
        for i in range(samples + 20):
            for k in range(len(rigs)):
                host, source, sub, gpus, home, times = rigs[(i + k) % len(rigs)]
                addr = gpus[i % len(gpus)]
                action = toggle(host, addr, home)
                props = host.uevent_props(action, addr)
                t0 = time.perf_counter_ns()
                source.push(props)
                await sub.receive()
                await anyio.lowlevel.checkpoint()  # the probe-changed of the same batch
                if i >= 20:
                    times.append((time.perf_counter_ns() - t0) / 1e3)
        return [r[5] for r in rigs]


def measure_gpu_toggle_log_on(small: SysRoot, big: SysRoot, samples: int) -> dict[str, float]:
    """µs per GPU bind/unbind with the log on, big host ÷ small host, interleaved."""
    with temp_dir("logon") as work:
        t_small, t_big = anyio.run(_toggle_with_log, [small, big], samples, work)
        sizes = [os.path.getsize(os.path.join(work, f"log{i}.jsonl")) for i in (0, 1)]
    return {"small_us": round(median(t_small), 1), "big_us": round(median(t_big), 1),
            "ratio": round(median(t_big) / median(t_small), 2),
            "log_bytes_per_event_big": round(sizes[1] / max(1, len(t_big) + 20), 0)}


# --------------------------------------------------------------------------- the real kernel


def _floor_drain(sock: socket.socket, count: int) -> int:
    got = 0
    while got < count:
        try:
            data = sock.recv(8192)
        except BlockingIOError:
            break
        _head, _, rest = data.partition(b"\0")
        dict(p.split(b"=", 1) for p in rest.split(b"\0") if b"=" in p)
        got += 1
    return got


def _kick(addr: str, times: int) -> None:
    fd = os.open(f"{REAL_PCI}/{addr}/uevent", os.O_WRONLY)
    try:
        for _ in range(times):
            os.write(fd, b"change")  # the only write to the real /sys: a synthetic uevent
    finally:
        os.close(fd)


def measure_kernel_vs_floor(rounds: int, burst: int) -> dict[str, float] | None:
    """Per event: kernel uevent → model (raw source, batch reads, apply) ÷ a raw socket that
    only receives and splits the same uevents. Both sockets get the same bursts."""
    found = real_device()
    if found is None:
        return None
    addr, devpath = found
    with temp_dir("kfloor") as root:
        host = mirror_device(root, addr, devpath)
        model = gpuwatch.scan(host.root)
        src = KernelSource()
        try:
            src.start()
        except Exception:
            return None
        watcher = Watcher(model, src, log=None, reconcile_interval=0, cdi_poll_interval=0,
                          subscriber_buffer=4096)
        floor = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_KOBJECT_UEVENT)
        floor.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
        floor.bind((0, 1))
        floor.setblocking(False)
        ours: list[float] = []
        base: list[float] = []
        home = {addr: HOME_DRIVER}
        try:
            for i in range(rounds):
                toggle(host, addr, home)
                _kick(addr, burst)
                time.sleep(0.02)  # let the kernel deliver them all
                # Alternate which drains first, so neither always meets the colder caches.
                for side in ((0, 1) if i % 2 else (1, 0)):
                    t0 = time.perf_counter_ns()
                    if side == 0:
                        n = _floor_drain(floor, burst)
                        if n:
                            base.append((time.perf_counter_ns() - t0) / n / 1e3)
                        continue
                    applied = 0
                    while True:
                        batch, _overflow, more = src._drain()
                        if batch:
                            # What the pump does with one source batch (in one slice).
                            observations = watcher._observe(watcher._collapse(batch))
                            observations.extend(f for e in batch for f in uevent_facts(e))
                            watcher.apply(observations)
                            applied += len(batch)
                        if not more:
                            break
                    if applied:
                        ours.append((time.perf_counter_ns() - t0) / applied / 1e3)
        finally:
            src.close()
            floor.close()
    if not ours:
        return None
    return {"ours_us": round(median(ours), 2), "floor_us": round(median(base), 2),
            "ratio": round(median(ours) / median(base), 2)}


# --------------------------------------------------------------------------- CLI and socket


@contextlib.contextmanager
def daemon_process(root: str, work: str) -> Iterator[str]:
    """``gpuwatch watch --socket`` on ``root`` (an idle FIFO source); yields the socket path."""
    fifo = os.path.join(work, "idle.fifo")
    os.mkfifo(fifo)
    path = os.path.join(work, "gw.sock")
    log = os.path.join(work, "events.jsonl")
    with subprocess.Popen(
        [sys.executable, "-m", "gpuwatch", "watch", "--root", root, "--source", "file:" + fifo,
         "--log", log, "--reconcile-interval", "0", "--socket", path],
        env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    ) as proc:
        try:
            deadline = time.monotonic() + 60
            while not os.path.exists(path):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the daemon did not come up")
                time.sleep(0.02)
            yield path
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _run_s(argv: list[str], env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, env=subprocess_env() if env is None else env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - t0


def compiled_env(work: str, commands: list[list[str]]) -> dict[str, str]:
    """The environment of cold starts with bytecode, as an installed package has it (pip
    compiles it; a checkout run under PYTHONDONTWRITEBYTECODE would compile every module
    from source on every start, which the interpreter baseline never does): one untimed run
    of each command writes the bytecode of everything it imports, ours and the standard
    library's alike, under a cache of its own, which every timed run then reads."""
    env = subprocess_env()
    env["PYTHONPYCACHEPREFIX"] = os.path.join(work, "pycache")
    warm = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
    for argv in commands:
        _run_s(argv, warm)
    return env


def _round_trips(path: str, request: bytes, count: int) -> float:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        times = []
        for _ in range(count):
            t0 = time.perf_counter_ns()
            sock.sendall(request)
            buf = b""
            while not buf.endswith(b"\n"):
                buf += sock.recv(1 << 16)
            times.append((time.perf_counter_ns() - t0) / 1e3)
    return median(times)


def _server_pid(path: str) -> int:
    """The pid of the process listening on a unix socket (its SO_PEERCRED)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid: int = struct.unpack("3i", creds)[0]
    return pid


@contextlib.contextmanager
def _same_placement(paths: list[str]) -> Iterator[None]:
    """Both servers on one CPU and this client on another, for the round trips: where the
    scheduler happens to put each process (with its client or across) otherwise decides a
    round trip's cost more than the server's own work does, and differs between the two."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        yield
        return
    pids = [_server_pid(p) for p in paths]
    saved = [(pid, os.sched_getaffinity(pid)) for pid in (0, *pids)]
    try:
        for pid in pids:
            os.sched_setaffinity(pid, {cpus[0]})
        os.sched_setaffinity(0, {cpus[1]})
        yield
    finally:
        for pid, mask in saved:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(pid, mask)


def measure_cli_and_socket(root: str, reps: int, trips: int) -> dict[str, float]:
    """Cold ``gpuwatch probe`` with and without a daemon, and ``gpuwatch status`` with one,
    against bare interpreter starts, and one socket round trip against a minimal asyncio
    NDJSON server, interleaved."""
    py = sys.executable
    with temp_dir("cli") as work, daemon_process(root, work) as sock:
        mini = os.path.join(work, "mini.sock")
        with subprocess.Popen([py, str(NDJSON_SERVER), mini]) as server:
            try:
                while not os.path.exists(mini):
                    time.sleep(0.01)
                commands = {
                    "with_d": [py, "-m", "gpuwatch", "probe", "detect-vfio", "--root", root,
                               "--socket", sock],
                    "import_base": [py, "-c", "import json, socket"],
                    "status_d": [py, "-m", "gpuwatch", "status", "--root", root,
                                 "--socket", sock],
                    "without": [py, "-m", "gpuwatch", "probe", "detect-vfio", "--root", root,
                                "--no-daemon"],
                    "bare": [py, "-c", "pass"],
                }
                env = compiled_env(work, list(commands.values()))
                times: dict[str, list[float]] = {name: [] for name in commands}
                for _ in range(reps):
                    for name, argv in commands.items():
                        times[name].append(_run_s(argv, env))
                with_d, import_base, status_d = (times["with_d"], times["import_base"],
                                                 times["status_d"])
                without, bare = times["without"], times["bare"]
                request = json.dumps({"id": 1, "method": "probe",
                                      "params": {"action": "detect-gpu"}}).encode() + b"\n"
                # Pairs taken back to back, which goes first alternating, and the median of
                # the pairs' ratios: on two shared cores a minute's drift (which core each
                # process lands on) moves both members of a pair together.
                ours, theirs, pairs = [], [], []
                with _same_placement([sock, mini]):
                    for i in range(9):
                        first, second = (sock, mini) if i % 2 == 0 else (mini, sock)
                        a = _round_trips(first, request, trips)
                        b = _round_trips(second, request, trips)
                        o, t = (a, b) if first == sock else (b, a)
                        ours.append(o)
                        theirs.append(t)
                        pairs.append(o / t)
            finally:
                server.terminate()
                server.wait()
    return {
        "cli_daemon_s": round(median(with_d), 3),
        "cli_daemon_ratio": round(median(with_d) / median(import_base), 2),
        "cli_status_s": round(median(status_d), 3),
        "cli_status_ratio": round(median(status_d) / median(import_base), 2),
        "cli_direct_s": round(median(without), 3),
        "cli_direct_ratio": round(median(without) / median(bare), 2),
        "import_json_socket_s": round(median(import_base), 3),
        "bare_s": round(median(bare), 3),
        "request_us": round(median(ours), 1),
        "request_baseline_us": round(median(theirs), 1),
        "request_ratio": round(median(pairs), 2),
    }


# --------------------------------------------------------------------------- fan-out, backlog, lag


#: The subscribers of the fan-out figure, in a process of their own so that their reading does
#: not count as the server's work: connect, subscribe, say so, read until each has ``events``.
_SUBSCRIBERS = """
import select, socket, sys
path, count, events = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
socks = []
for _ in range(count):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(b'{"id":1,"method":"subscribe","params":{}}\\n')
    buf = b""
    while b"\\n" not in buf:
        buf += s.recv(65536)
    socks.append(s)
print("ready", flush=True)
left = {s: events for s in socks}
while left:
    for s in select.select(list(left), [], [])[0]:
        left[s] -= s.recv(1 << 20).count(b"\\n")
        if left[s] <= 0:
            del left[s]
print("done", flush=True)
"""


async def _fanout(root: str, subscribers: int, events: int) -> float:
    """The server's CPU µs per published event until every one of ``subscribers`` clients
    (another process: their reading is not counted) has read it. What the process held before
    the clock starts is out of the collector's sight while it runs, as `gpuwatch watch` keeps
    its start-up heap (`freeze_startup_heap`): a full collection of the benchmark's own
    fixtures is no part of the fan-out."""
    with short_socket_dir() as sockdir:
        path = f"{sockdir}/gw.sock"
        async with served_watcher(root, path) as served, await anyio.open_process(
            [sys.executable, "-c", _SUBSCRIBERS, path, str(subscribers), str(events)]
        ) as proc:
            assert proc.stdout is not None
            out = b""
            while b"ready" not in out:
                out += await proc.stdout.receive()
            w = served.watcher
            freeze_startup_heap()
            try:
                cpu0 = time.process_time()
                published = 0
                while published < events:
                    n = min(PUMP_SLICE, events - published)
                    w.publish([_note(k) for k in range(n)])
                    published += n
                    await anyio.lowlevel.checkpoint()
                while b"done" not in out:
                    out += await proc.stdout.receive()
                cpu = time.process_time() - cpu0
            finally:
                gc.unfreeze()
    return cpu / events * 1e6


def _note(k: int) -> Any:
    from gpuwatch.core.events import NodeAdded

    return NodeAdded(path=f"/dev/bench{k}")


def measure_fanout(root: str, events: int, pairs: int) -> dict[str, float]:
    """Server CPU per published event until every socket subscriber has read it: 100 ÷ 1,
    in back-to-back pairs whose order alternates; the row is the median of the pairs'
    ratios (the host taking the vCPU away moves both members of a pair alike)."""
    one, many, ratios = [], [], []
    for i in range(pairs):
        counts = (1, 100) if i % 2 == 0 else (100, 1)
        got = {n: anyio.run(_fanout, root, n, events) for n in counts}
        one.append(got[1])
        many.append(got[100])
        ratios.append(got[100] / got[1])
    return {"one_us": round(median(one), 2), "hundred_us": round(median(many), 2),
            "ratio": round(median(ratios), 2)}


async def _backlog(host: SysRoot, total: int) -> tuple[float, float]:
    """Seconds until a probe is answered, and until the backlog is applied: ``total`` change
    uevents cycling over every function of the host (each slice reads real devices)."""
    events = [host.uevent_props("change", a) for a in sorted(host.functions)]
    with short_socket_dir() as sockdir:
        path = f"{sockdir}/gw.sock"
        async with served_watcher(host.root, path) as served:
            w = served.watcher
            applied: list[float] = []
            inner = w.apply

            def counting(observations: Any) -> Any:
                result = inner(observations)
                applied.append(time.perf_counter())
                return result

            w.apply = counting  # type: ignore[method-assign]
            source = served.source
            assert isinstance(source, MemorySource)
            stream = await anyio.connect_unix(path)
            async with stream:
                request = b'{"id":1,"method":"probe","params":{"action":"detect-gpu"}}\n'
                await stream.send(request)  # a client already connected and served once
                buf = b""
                while b"\n" not in buf:
                    buf += await stream.receive()
                applied.clear()
                for i in range(total):
                    source.push(events[i % len(events)])
                t0 = time.perf_counter()
                await stream.send(request)
                buf = b""
                while b"\n" not in buf:
                    buf += await stream.receive()
                answered = time.perf_counter() - t0
                # One source batch, one read per device it names, applied in slices.
                unique = min(total, len(events))
                while len(applied) < -(-unique // PUMP_SLICE):
                    await anyio.sleep(0.001)
                done = applied[-1] - t0
    return answered, done


def measure_backlog(host: SysRoot, total: int, rounds: int) -> dict[str, float]:
    got = [anyio.run(_backlog, host, total) for _ in range(rounds)]
    return {"answered_ms": round(median([a for a, _ in got]) * 1e3, 1),
            "backlog_ms": round(median([d for _, d in got]) * 1e3, 1)}


async def _burst(host: SysRoot) -> tuple[int, int]:
    source = MemorySource()
    async with open_watcher(host.root, source, reconcile_interval=0, cdi_poll_interval=0) as w:
        home = {a: current_driver(host, a) or HOME_DRIVER for a in host.functions}
        addrs = sorted(host.functions)
        got = 0
        lagged = 0
        async with w.subscribe() as sub:
            for addr in addrs:
                source.push(host.uevent_props(toggle(host, addr, home), addr))
            try:
                with anyio.fail_after(120):
                    while got < len(addrs):
                        event = await sub.receive()
                        got += event.type == "driver-changed"
            except gpuwatch.SubscriberLagged:
                lagged = 1
    for addr in addrs:  # put the tree back: a second toggle undoes the first
        toggle(host, addr, home)
    return got, lagged


def measure_burst(host: SysRoot) -> dict[str, int]:
    """A burst of one driver change per function (4,096 for the big host) to an in-process
    subscriber with the default buffer that reads as fast as it can: lagged or not."""
    got, lagged = anyio.run(_burst, host)
    return {"events": got, "lag_notices": lagged}


# --------------------------------------------------------------------------- storm reader


def measure_storm_vs_reader(host: SysRoot, events: int, runs: int) -> dict[str, float]:
    """The storm through gpuwatch (file: FIFO source, log on) ÷ the same storm through each
    stdlib reader (one write per chunk; one line-buffered write per line), interleaved."""
    from benchmarks.harness import run_storm

    ours, batched, per_line = [], [], []
    lost = 0
    reader = [sys.executable, str(STORM_READER)]
    for _ in range(runs):
        r = run_storm(host, events)
        ours.append(r.rate)
        lost += r.events - r.produced
        batched.append(run_storm(host, events, reader=reader).rate)
        per_line.append(run_storm(host, events, reader=[*reader, "--per-line"]).rate)
    return {"ours_per_s": round(median(ours)), "reader_per_s": round(median(batched)),
            "ratio": round(median(ours) / median(batched), 2),
            "per_line_reader_per_s": round(median(per_line)),
            "per_line_ratio": round(median(ours) / median(per_line), 2), "lost": lost}


def run_ratios(s: Settings, small: SysRoot, big: SysRoot, storm_host: SysRoot,
               progress: Callable[[str], None]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    progress("ratios: cached probe ÷ an empty method call")
    out["probe_vs_empty_call"] = measure_probe_vs_empty(str(storm_host.root), s)
    progress("ratios: GPU bind/unbind with the log on, big host ÷ small host")
    out["gpu_toggle_log_on"] = measure_gpu_toggle_log_on(small, big, s.ratio_toggles)
    progress("ratios: real kernel uevent → model ÷ a raw-socket parse floor")
    out["kernel_vs_floor"] = (measure_kernel_vs_floor(s.ratio_kernel_rounds, 200)
                              if s.kernel else None)
    progress("ratios: CLI cold starts and one socket request")
    out["cli_and_socket"] = measure_cli_and_socket(str(storm_host.root), s.ratio_cli_reps,
                                                   s.ratio_trips)
    progress("ratios: 100 socket subscribers ÷ 1")
    out["fanout"] = measure_fanout(str(storm_host.root), s.ratio_fanout_events,
                                   s.ratio_fanout_pairs)
    progress("ratios: a probe behind a backlog of 10,000 uevents")
    out["backlog"] = measure_backlog(storm_host, 10_000, 3)
    progress("ratios: in-process subscriber during a burst")
    out["burst"] = measure_burst(big)
    progress(f"ratios: probe p99 while a client replays a {s.ratio_replay_mib} MiB log ÷ idle")
    out["replay"] = (measure_replay(s.ratio_replay_mib, s.ratio_replay_probes,
                                    s.ratio_replay_rounds) if s.ratio_replay_mib else None)
    progress("ratios: storm ÷ minimal stdlib reader")
    out["storm_vs_reader"] = measure_storm_vs_reader(storm_host, s.storm_events,
                                                     max(1, s.storm_runs // 2))
    return out


def format_ratio_rows(r: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    for action, ratio in r["probe_vs_empty_call"].items():
        rows.append((f"cached probe {action} ÷ empty method call", f"{ratio:.2f}x", "≤ 2x"))
    g = r["gpu_toggle_log_on"]
    rows.append(("GPU bind/unbind, log on, N=4096 ÷ N=64",
                 f"{g['ratio']:.2f}x ({g['big_us']:,.0f} / {g['small_us']:,.0f} µs, "
                 f"{g['log_bytes_per_event_big']:,.0f} B of log/event)", "≤ 1.5x"))
    k = r["kernel_vs_floor"]
    rows.append(("kernel uevent → model ÷ raw-socket parse floor",
                 "n/a" if k is None else
                 f"{k['ratio']:.2f}x ({k['ours_us']} / {k['floor_us']} µs per event)", "≤ 2x"))
    st = r["storm_vs_reader"]
    rows.append(("storm, N=1024, log on ÷ minimal stdlib reader (a write per chunk)",
                 f"{st['ratio']:.2f}x ({st['ours_per_s']:,} / {st['reader_per_s']:,}/s, "
                 f"{st['lost']} lost)", "≥ 0.7x, 0 lost"))
    rows.append(("  the same ÷ a stdlib reader writing each line as it goes",
                 f"{st['per_line_ratio']:.2f}x ({st['ours_per_s']:,} / "
                 f"{st['per_line_reader_per_s']:,}/s)", "≥ 0.7x"))
    c = r["cli_and_socket"]
    rows.append(("`gpuwatch probe` cold, daemon up ÷ python -c 'import json, socket'",
                 f"{c['cli_daemon_ratio']:.2f}x ({c['cli_daemon_s'] * 1e3:,.0f} / "
                 f"{c['import_json_socket_s'] * 1e3:,.0f} ms)", "≤ 2x"))
    rows.append(("`gpuwatch status` cold, daemon up ÷ python -c 'import json, socket'",
                 f"{c['cli_status_ratio']:.2f}x ({c['cli_status_s'] * 1e3:,.0f} / "
                 f"{c['import_json_socket_s'] * 1e3:,.0f} ms)", "≤ 2x"))
    rows.append(("`gpuwatch probe` cold, no daemon ÷ bare interpreter",
                 f"{c['cli_direct_ratio']:.2f}x ({c['cli_direct_s'] * 1e3:,.0f} / "
                 f"{c['bare_s'] * 1e3:,.0f} ms)", "≤ 5x"))
    rows.append(("one socket request ÷ minimal asyncio NDJSON server",
                 f"{c['request_ratio']:.2f}x ({c['request_us']:,.0f} / "
                 f"{c['request_baseline_us']:,.0f} µs round trip)", "≤ 1.5x"))
    f = r["fanout"]
    rows.append(("per event (server CPU), 100 socket subscribers ÷ 1",
                 f"{f['ratio']:.2f}x ({f['hundred_us']} / {f['one_us']} µs)", "≤ 1.5x"))
    b = r["backlog"]
    rows.append(("probe behind a backlog of 10,000 uevents",
                 f"answered after {b['answered_ms']} ms (backlog done after {b['backlog_ms']} ms)",
                 "≤ 50 ms, before the backlog"))
    p = r["replay"]
    rows.append((f"probe p99 during a {p['log_mib'] if p else '…'} MiB log replay ÷ idle p99",
                 "n/a" if p is None else
                 f"{p['ratio']:.2f}x ({p['slow_reader_p99_us']:,.0f} / "
                 f"{p['idle_p99_us']:,.0f} µs, a reader taking 64 KiB every 2 ms)", "≤ 2x"))
    rows.append(("the same, a reader flat out ÷ idle p99",
                 "n/a" if p is None else
                 f"{p['fast_ratio']:.2f}x ({p['fast_reader_p99_us']:,.0f} / "
                 f"{p['idle_p99_us']:,.0f} µs; a CPU-burning process alone: "
                 f"{p['busy_p99_us']:,.0f} µs)", "≤ 2x"))
    rows.append(("replay stops after its client hangs up",
                 "n/a" if p is None else f"{p['stop_after_hangup_s'] * 1e3:,.0f} ms", "≤ 1 s"))
    u = r["burst"]
    rows.append(("in-process subscriber, burst of one change per function (N=4096)",
                 f"{u['lag_notices']} lag notices, {u['events']:,} events read", "no lag notice"))
    return rows


__all__ = ["format_ratio_rows", "run_ratios"]
