"""An orchestrator embedding gpuwatch: reads from other threads while the watcher applies a
storm, and cancellation and teardown at awkward moments, on both anyio backends.

The reads a server's thread pool makes (``probe``, ``functions``, ``snapshot``,
``kept_for_host``) must neither raise while the loop applies a batch nor return an answer
no state of the model ever had: every answer is checked against the states the watcher
published, recorded on its own loop."""

from __future__ import annotations

import bisect
import contextlib
import gc
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from test_embedding import BACKENDS, NIC, NV, _trio_usable, open_fds, open_quiet

import gpuwatch
from gpuwatch.core.results import DetectVfioResult, PciFunction
from gpuwatch.host import Host
from gpuwatch.sources.memory import MemorySource
from gpuwatch.testing import SysRoot, example_gpu_host
from gpuwatch.testing.simkernel import simulated_switch
from gpuwatch.watch import watcher as watcher_mod

pytestmark = pytest.mark.timeout(120)

AUDIO = "0000:01:00.1"
#: A second card that comes and goes during the storm (the functions dict changes size).
SPARE = "0000:03:00.0"
READERS = 3

Signature = tuple[tuple[str, str, int], ...]


def signature(functions: list[PciFunction] | tuple[PciFunction, ...]) -> Signature:
    """What a state of the model is, for these tests: every function's driver and group."""
    return tuple((f.addr, f.driver, f.iommu_group) for f in functions)


@contextmanager
def fast_thread_switches() -> Iterator[None]:
    """Hand the GIL over far more often than every 5 ms, so a read lands inside a batch."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


@dataclass
class Recorded:
    """The states the watcher passed through, recorded on its loop as each batch published:
    seq -> (signature, the detect-vfio answer then)."""

    at: dict[int, tuple[Signature, Any]] = field(default_factory=dict)

    def take(self, w: Host) -> None:
        self.at[w.seq] = (signature(w.model.functions()), w.probe("detect-vfio"))

    def state_at(self, seq: int) -> tuple[Signature, Any]:
        """The state after the last batch published at or before ``seq``."""
        seqs = sorted(self.at)
        return self.at[seqs[bisect.bisect_right(seqs, seq) - 1]]

    def signatures(self) -> set[Signature]:
        return {sig for sig, _ in self.at.values()}


@dataclass
class Seen:
    """What the reader threads got."""

    errors: list[BaseException] = field(default_factory=list)
    functions: set[Signature] = field(default_factory=set)
    #: (seq, signature, detect-vfio) of each snapshot, and each detect-vfio answer, once.
    snapshots: set[tuple[int, Signature, Any]] = field(default_factory=set)
    vfio: set[Any] = field(default_factory=set)
    reads: int = 0


def read_everything(w: Host, seen: Seen) -> None:
    """One round of every read a server would answer from another thread."""
    seen.functions.add(signature(w.model.functions()))
    snap = w.snapshot()
    seen.snapshots.add((snap.seq, signature(snap.functions), snap.probes["detect-vfio"]))
    seen.vfio.add(w.probe("detect-vfio"))
    for addr in (NV, AUDIO, NIC, SPARE):
        try:
            w.probe("group-in-mode", addr=addr, mode="vfio")
            w.probe("current-mode", addr=addr)
            w.probe("display-driver", addr=addr)
            w.probe("vfio-backend", addr=addr)
            w.model.kept_for_host(addr)
        except gpuwatch.DeviceNotFound:
            pass  # the spare card, while it is away
    with contextlib.suppress(gpuwatch.SwitchRefused):  # the model's part at one state
        w.probe("plan", addr=NV, mode="vfio")
    for group in (13, 14, 15):
        w.probe("vfio-group-accessible", group=group)
    w.probe("detect-host-devices")
    seen.reads += 1


def read_snapshots(w: Host, seen: Seen) -> None:
    snap = w.snapshot()
    seen.snapshots.add((snap.seq, signature(snap.functions), snap.probes["detect-vfio"]))
    seen.reads += 1


def start_readers(w: Host, seen: Seen, stop: threading.Event,
                  read: Callable[[Host, Seen], None]) -> list[threading.Thread]:
    def loop() -> None:
        while not stop.is_set():
            try:
                read(w, seen)
            except BaseException as exc:  # every failure is the test's finding
                seen.errors.append(exc)
                return

    threads = [threading.Thread(target=loop, name=f"reader-{i}", daemon=True)
               for i in range(READERS)]
    for thread in threads:
        thread.start()
    return threads


Step = Callable[[], list[dict[str, str]]]


@dataclass
class Storm:
    """Tree changes as the kernel makes them, each with its uevents (binds and unbinds of a
    whole group, a function moving between groups, a card coming and going), and what each
    function's driver and group are once the watcher has read them all."""

    host: SysRoot
    steps: list[Step] = field(default_factory=list)
    expected: dict[str, tuple[str, int] | None] = field(default_factory=dict)

    def settled(self, w: Host) -> bool:
        """Whether the model holds every change made so far (a batch read after a later
        change folds the earlier one in: a step may publish nothing of its own)."""
        functions = w.model.state.functions
        for addr, want in self.expected.items():
            fn = functions.get(addr)
            if (None if fn is None else (fn.driver, fn.iommu_group)) != want:
                return False
        return True


def storm_of(host: SysRoot, *, spare: bool = True) -> Storm:
    storm = Storm(host)
    expected = storm.expected

    def rebind(addr: str, driver: str, group: int) -> Step:
        def step() -> list[dict[str, str]]:
            host.unbind(addr)
            host.bind(addr, driver)
            expected[addr] = (driver, group)
            return [host.uevent_props("unbind", addr), host.uevent_props("bind", addr)]
        return step

    def move(addr: str, driver: str, group: int) -> Step:
        def step() -> list[dict[str, str]]:
            host.set_iommu_group(addr, group)
            expected[addr] = (driver, group)
            return [host.uevent_props("change", addr)]
        return step

    def add_spare() -> list[dict[str, str]]:
        host.add_function(SPARE, driver="nvidia", iommu_group=15)
        expected[SPARE] = ("nvidia", 15)
        return [host.uevent_props("add", SPARE)]

    def remove_spare() -> list[dict[str, str]]:
        host.remove_function(SPARE)
        expected[SPARE] = None
        return [host.uevent_props("remove", SPARE)]

    storm.steps = [rebind(NV, "vfio-pci", 13), rebind(AUDIO, "vfio-pci", 13),
                   move(NIC, "igb", 13), rebind(NV, "nvidia", 13), move(NIC, "igb", 14),
                   rebind(AUDIO, "snd_hda_intel", 13)]
    if spare:
        storm.steps[3:3] = [add_spare]
        storm.steps.append(remove_spare)
    return storm


def check_answers(recorded: Recorded, seen: Seen) -> None:
    """Every answer a reader got is the answer of a state the watcher published."""
    assert not seen.errors, f"a read from another thread raised: {seen.errors[0]!r}"
    assert seen.reads > 0
    states = recorded.signatures()
    torn = seen.functions - states
    assert not torn, f"functions() returned a state the model never had: {sorted(torn)[0]}"
    for seq, sig, vfio in seen.snapshots:
        want_sig, want_vfio = recorded.state_at(seq)
        assert sig == want_sig, f"snapshot at seq {seq} holds the functions of another seq"
        assert vfio == want_vfio, f"snapshot at seq {seq} holds detect-vfio of another seq"
    answers = [v for _sig, v in recorded.at.values()]
    for vfio in seen.vfio:
        assert isinstance(vfio, DetectVfioResult)
        assert any(vfio is a for a in answers), "detect-vfio answered a state never published"
        for gpu in vfio.gpus:
            members = {m.addr: m for m in gpu.group_members}
            assert members[gpu.addr].driver == gpu.driver
            assert all(m.iommu_group == gpu.iommu_group for m in members.values())


def run_storm(host: SysRoot, backend: str, read: Callable[[Host, Seen], None], *,
              spare: bool = True, holders: bool = False) -> tuple[Recorded, Seen]:
    """Storm ``host`` through a memory source while `READERS` threads ``read`` in a loop
    (and, with ``holders``, a task asks `Host.holders` over and over); what was recorded
    on the loop, and what the readers saw."""
    recorded, seen = Recorded(), Seen()

    async def main() -> None:
        source = MemorySource()
        async with open_quiet(host.root, source) as w:
            recorded.take(w)
            w.batch_listeners.append(lambda events, lines: recorded.take(w))
            stop = threading.Event()

            async def ask_holders() -> None:
                # `Host.holders` reads the model in a worker thread of its own.
                while not stop.is_set():
                    try:
                        await w.holders(NV)
                    except Exception as exc:
                        seen.errors.append(exc)
                        return

            with fast_thread_switches():
                readers = start_readers(w, seen, stop, read)
                try:
                    async with anyio.create_task_group() as tg:
                        if holders:
                            tg.start_soon(ask_holders)
                        await run_steps(w, source, storm_of(host, spare=spare))
                        stop.set()
                finally:
                    stop.set()
                    for thread in readers:
                        await anyio.to_thread.run_sync(thread.join, 10)
            # The storm is over: the model agrees with the tree.
            await w.resync("reconcile")
            assert signature(w.model.functions()) == signature(
                gpuwatch.scan(host.root).functions())

    anyio.run(main, backend=backend)
    return recorded, seen


@pytest.mark.parametrize("backend", BACKENDS)
def test_reads_from_other_threads_during_a_storm_are_whole_answers(tmp_path: Path,
                                                                    backend: str) -> None:
    host = example_gpu_host(tmp_path / "host")
    check_answers(*run_storm(host, backend, read_everything, holders=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_snapshot_from_another_thread_is_the_model_at_its_seq(tmp_path: Path,
                                                                 backend: str) -> None:
    """Binds and group moves only: nothing raises, so what is left to see is a snapshot
    whose functions are those of a later batch than its seq."""
    host = example_gpu_host(tmp_path / "host")
    recorded, seen = run_storm(host, backend, read_snapshots, spare=False)
    assert seen.snapshots
    check_answers(recorded, seen)


async def run_steps(w: Host, source: MemorySource, storm: Storm) -> None:
    """Every step 40 times: half the rounds each step read before the next, half left to
    pile up into batches."""
    with anyio.fail_after(60):
        for round_ in range(40):
            for step in storm.steps:
                for props in step():
                    source.push(props)
                await anyio.sleep(0)
                while not round_ % 2 and not storm.settled(w):
                    await anyio.sleep(0.001)


# --------------------------------------------------------------------------- teardown

#: Threads a backend keeps idle for its next job, not left behind by gpuwatch.
POOLED = ("AnyIO worker thread", "Trio thread")


def stray_threads(before: set[threading.Thread]) -> list[str]:
    """Threads started since ``before`` that are still alive after a moment (a worker
    finishing an abandoned read is given the time to), pooled idle workers aside."""
    deadline = time.monotonic() + 10
    while True:
        stray = [t.name for t in threading.enumerate()
                 if t not in before and not t.name.startswith(POOLED)]
        if not stray or time.monotonic() > deadline:
            return stray
        time.sleep(0.01)


def held_scan() -> tuple[Callable[[Any, Any], Any], threading.Event, threading.Event]:
    """(a stand-in for the watcher's `scan` that holds until released, set when it has
    begun, the release)."""
    real_scan = watcher_mod.scan
    scanning, release = threading.Event(), threading.Event()

    def slow_scan(paths: Any, tables: Any) -> Any:
        scanning.set()
        release.wait(10)
        return real_scan(paths, tables)

    return slow_scan, scanning, release


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancelled_during_the_initial_scan_it_leaves_nothing_and_opens_again(
        host: SysRoot, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM while a large host is still being scanned: the scan is abandoned at once,
    its source and its log's lock released then, and the scan's thread ends on its own."""
    real_scan = watcher_mod.scan
    slow_scan, scanning, release = held_scan()

    log = host.root / "events.jsonl"

    async def main() -> None:
        before_fds, before_threads = open_fds(), set(threading.enumerate())
        monkeypatch.setattr(watcher_mod, "scan", slow_scan)
        with anyio.fail_after(10), anyio.move_on_after(0.2) as scope:
            async with open_quiet(host.root, "kernel", log=log):
                pytest.fail("the body ran before the scan was done")
        assert scope.cancelled_caught and scanning.is_set()
        assert open_fds() == before_fds  # while the abandoned scan still runs
        release.set()
        assert stray_threads(before_threads) == []
        monkeypatch.setattr(watcher_mod, "scan", real_scan)
        async with open_quiet(host.root, "kernel", log=log) as w:  # the log's lock is free
            assert w.probe("display-driver", addr=NV) == "nvidia"

    anyio.run(main, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_subscribers_outlive_a_cancelled_watcher_and_one_that_raises_harms_none(
        host: SysRoot, backend: str) -> None:
    """Subscribers in the orchestrator's own task group: one whose body raises leaves the
    other hearing events; when the task holding the watcher is cancelled, a subscriber
    blocked in ``async for`` sees its stream end (not a hang, not an error), and a new
    subscription says the watcher is closed."""
    heard: list[str] = []
    failures: list[BaseException] = []

    async def main() -> None:
        before_fds = open_fds()
        source = MemorySource()
        box: list[Host] = []

        async def hold_watcher(task_status: anyio.abc.TaskStatus[None]) -> None:
            async with open_quiet(host.root, source) as w:
                box.append(w)
                task_status.started()
                await anyio.sleep_forever()

        async def listen(w: Host, ready: anyio.Event) -> None:
            async with w.subscribe(types={"driver-changed"}) as sub:
                ready.set()
                async for event in sub:
                    heard.append(event.addr)
            heard.append("end")

        async def fail_on_first(w: Host, ready: anyio.Event) -> None:
            try:
                async with w.subscribe(types={"driver-changed"}) as sub:
                    ready.set()
                    async for _event in sub:
                        raise RuntimeError("the orchestrator's own bug")
            except RuntimeError as exc:
                failures.append(exc)

        with anyio.fail_after(20):
            async with (anyio.create_task_group() as outer,
                        anyio.create_task_group() as watching):
                await watching.start(hold_watcher)
                w = box[0]
                ready = [anyio.Event(), anyio.Event()]
                outer.start_soon(listen, w, ready[0])
                outer.start_soon(fail_on_first, w, ready[1])
                for event in ready:
                    await event.wait()
                for addr in (NIC, NV):
                    host.unbind(addr)
                    source.push(host.uevent_props("unbind", addr))
                    while addr not in heard:
                        await anyio.sleep(0.005)
                assert len(failures) == 1 and len(w.watcher._subscribers) == 1
                watching.cancel_scope.cancel()  # the task holding the watcher
        assert heard == [NIC, NV, "end"]
        with pytest.raises(gpuwatch.WatcherClosed, match="closed"):
            async with w.subscribe():
                pass
        assert w.watcher._subscribers == []
        assert open_fds() == before_fds

    anyio.run(main, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancelled_mid_switch_it_leaves_nothing_and_the_next_switch_completes(
        tmp_path: Path, backend: str) -> None:
    host = example_gpu_host(tmp_path / "host")

    async def main() -> list[str]:
        before_fds, before_threads = open_fds(), set(threading.enumerate())
        midway = 0
        for delay in (0.0, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.1):
            events: list[Any] = []  # (none, when the cancel comes before the watcher is up)
            with anyio.fail_after(30), anyio.move_on_after(delay):
                async with simulated_switch(host) as (h, _sim, _engine, events):
                    # back and forth, so that every cancel finds a switch to interrupt
                    there = "nvidia" if h.probe("current-mode", addr=NV) == "vfio" else "vfio"
                    await h.switch(NV, there)
            types = {e.type for e in events}
            midway += "switch-started" in types and "switch-completed" not in types
            gc.collect()  # what the cancel abandoned goes now, inside the run (trio warns)
        assert midway, "no cancel came while a switch was running"
        assert open_fds() == before_fds
        assert stray_threads(before_threads) == []
        async with simulated_switch(host) as (h, _sim, _engine, _events):
            with anyio.fail_after(30):
                await h.switch(NV, "vfio")
            return [h.probe("display-driver", addr=a) for a in (NV, AUDIO)]

    assert anyio.run(main, backend=backend) == ["vfio-pci", "vfio-pci"]


class KeptSource(MemorySource):
    """A memory source that keeps the iterator it hands the watcher, to look at after."""

    iterator: Any = None

    def batches(self) -> Any:
        self.iterator = super().batches()
        return self.iterator


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pump_cancelled_while_it_waits_for_the_lock_closes_its_source_iterator(
        host: SysRoot, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The watcher closes while a batch waits for a resync to finish: the pump is cancelled
    outside the source's iterator, which is closed there and then, not left suspended for
    the garbage collector (trio warns of such an abandoned generator, and an embedder that
    runs with warnings as errors fails on it)."""
    slow_scan, scanning, release = held_scan()

    async def main() -> None:
        source = KeptSource()
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg, open_quiet(host.root, source) as w:
                monkeypatch.setattr(watcher_mod, "scan", slow_scan)
                tg.start_soon(w.resync, "reconcile")  # (it ends once the scan is let go)
                while not scanning.is_set():
                    await anyio.sleep(0.005)
                host.unbind(NIC)
                source.push(host.uevent_props("unbind", NIC))
                while not w.watcher._lock.statistics().tasks_waiting:
                    await anyio.sleep(0.005)  # the pump holds the batch and waits its turn
                threading.Timer(0.1, release.set).start()
        assert source.iterator is not None
        assert source.iterator.ag_frame is None, "the source's iterator was left suspended"

    anyio.run(main, backend=backend)


# --------------------------------------------------------------------------- two at once


def test_a_watcher_per_event_loop_in_two_threads_each_follows_the_host(tmp_path: Path) -> None:
    """Two threads, each with its own loop (one asyncio, one trio where it is usable) and
    its own watcher of the same root: each hears every change, and neither's reads see
    the other's."""
    host = example_gpu_host(tmp_path / "host")
    backends = ["asyncio", "trio" if _trio_usable() else "asyncio"]
    ready = threading.Barrier(3, timeout=10)
    changed = threading.Event()
    uevent: dict[str, str] = {}
    results: dict[int, Any] = {}

    def run(index: int) -> None:
        async def main() -> list[str]:
            source = MemorySource()
            async with (open_quiet(host.root, source) as w,
                        w.subscribe(types={"driver-changed"}) as sub):
                await anyio.to_thread.run_sync(ready.wait)
                await anyio.to_thread.run_sync(changed.wait, 10)
                source.push(uevent)  # a source is its loop's: pushed on that thread
                with anyio.fail_after(10):
                    event = await sub.__anext__()
                return [event.addr, w.probe("display-driver", addr=NIC) or "none"]

        try:
            results[index] = anyio.run(main, backend=backends[index])
        except BaseException as exc:
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in (0, 1)]
    for thread in threads:
        thread.start()
    ready.wait()
    host.unbind(NIC)
    uevent.update(host.uevent_props("unbind", NIC))
    changed.set()
    for thread in threads:
        thread.join(20)
    assert results == {0: [NIC, "none"], 1: [NIC, "none"]}


async def test_two_watchers_of_one_root_in_one_loop_each_follow_it_and_share_no_log(
        host: SysRoot) -> None:
    """An orchestrator with two watchers of the same root (two components, each its own):
    both hear a change; a second writer of one event log is refused in words, and the
    first watcher goes on unharmed."""
    log = host.root / "events.jsonl"
    first, second = MemorySource(), MemorySource()
    async with (open_quiet(host.root, first, log=log) as a,
                open_quiet(host.root, second) as b,
                a.subscribe(types={"driver-changed"}) as heard_a,
                b.subscribe(types={"driver-changed"}) as heard_b):
        with pytest.raises(gpuwatch.HostError, match="one writer"):
            async with open_quiet(host.root, MemorySource(), log=log):
                pass
        host.unbind(NIC)
        for source in (first, second):
            source.push(host.uevent_props("unbind", NIC))
        with anyio.fail_after(10):
            assert (await heard_a.__anext__()).addr == NIC
            assert (await heard_b.__anext__()).addr == NIC
        assert a.snapshot().functions == b.snapshot().functions
