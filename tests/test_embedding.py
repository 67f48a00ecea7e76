"""The embedding API as an orchestrator uses it: both anyio backends, cancellation, threads,
bad arguments and exceptions reaching the caller as themselves."""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
from collections.abc import Awaitable, Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import anyio
import pytest

import gpuwatch
from gpuwatch.core.events import DriverChanged, SwitchCompleted
from gpuwatch.host import Host
from gpuwatch.sources.memory import MemorySource
from gpuwatch.testing import SysRoot, example_gpu_host
from gpuwatch.testing.simkernel import simulated_switch

NV, NIC = "0000:01:00.0", "0000:02:00.0"


def _trio_usable() -> bool:
    """anyio's trio backend needs a recent trio (abandon_on_cancel, 0.32+)."""
    try:
        major, minor = (int(p) for p in version("trio").split(".")[:2])
    except Exception:
        return False
    return (major, minor) >= (0, 32)


BACKENDS = [
    "asyncio",
    pytest.param("trio", marks=pytest.mark.skipif(not _trio_usable(),
                                                  reason="trio >= 0.32 is not installed")),
]


def open_quiet(root: str | os.PathLike[str], source: Any = None,
               **options: Any) -> Any:
    return gpuwatch.open_watcher(root, source if source is not None else MemorySource(),
                                 reconcile_interval=0, cdi_poll_interval=0,
                                 vgpu_poll_interval=0, **options)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def run_in_thread(fn: Callable[[], Awaitable[Any]], backend: str) -> dict[str, Any]:
    """Run ``fn`` in a new thread with its own event loop; its result or exception."""
    box: dict[str, Any] = {}

    def main() -> None:
        try:
            box["result"] = anyio.run(fn, backend=backend)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the other thread's call hung"
    return box


# --------------------------------------------------------------------------- both backends


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_documented_embedding_works_on_both_backends(host: SysRoot, backend: str) -> None:
    async def main() -> list[Any]:
        source = MemorySource()
        async with open_quiet(host.root, source) as w:
            assert w.probe("detect-vfio").iommu_enabled
            async with w.subscribe(types={"driver-changed"}, addrs={NIC}) as events:
                host.unbind(NIC)
                source.push(host.uevent_props("unbind", NIC))
                with anyio.fail_after(5):
                    first = await events.__anext__()

            async def later() -> None:
                await anyio.sleep(0.01)
                host.bind(NIC, "igb")
                source.push(host.uevent_props("bind", NIC))

            async with anyio.create_task_group() as tg:
                tg.start_soon(later)
                second = await w.wait_for(lambda e: isinstance(e, DriverChanged), timeout=5)
            return [(first.old, first.new), (second.old, second.new), w.snapshot().seq]

    assert anyio.run(main, backend=backend) == [("igb", ""), ("", "igb"), 3]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_switch_runs_on_both_backends(tmp_path: Path, backend: str) -> None:
    host = example_gpu_host(tmp_path / "host")

    async def main() -> list[str]:
        async with simulated_switch(host) as (h, _sim, _engine, _events):
            with anyio.fail_after(30):
                await h.switch(NV, "vfio")
            return [h.probe("display-driver", addr=a) for a in (NV, "0000:01:00.1")]

    assert anyio.run(main, backend=backend) == ["vfio-pci", "vfio-pci"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("leave", ["done", "cancelled"])
def test_a_switch_in_a_task_outside_the_context_ends_before_the_watcher_closes(
        tmp_path: Path, backend: str, leave: str) -> None:
    """A task group around `open_host` (a trio nursery's usual place) runs a switch, and the
    body leaves while it runs: the context waits for the switch, so it ends with the watcher
    still there to re-read the tree and log its end. Left as done, the switch completes;
    cancelled with the group, it is rolled back. Was: the log closed under it, the caller
    got an internal EventLogClosedError, and no switch-completed/-failed was ever logged."""
    from gpuwatch.host import open_host
    from gpuwatch.testing.simkernel import SimKernel

    host = example_gpu_host(tmp_path / "host")
    log = tmp_path / "events.jsonl"
    sim = SimKernel(host)
    sim.step_delay = 0.05  # a switch of about half a second

    async def main() -> list[Any]:
        got: list[Any] = []
        sim.source = MemorySource()
        with anyio.fail_after(30):
            # The task group outside the host's context, as a trio nursery usually sits.
            async with anyio.create_task_group() as tg, open_host(
                    host.root, source=sim.source, ops=sim, geteuid=lambda: 0, log=log,
                    reconcile_interval=0, cdi_poll_interval=0) as h:

                async def switch() -> None:
                    try:
                        got.append(await h.switch(NV, "vfio"))
                    except anyio.get_cancelled_exc_class():
                        got.append("cancelled")
                        raise
                    except Exception as exc:
                        got.append(exc)

                tg.start_soon(switch)
                await anyio.sleep(0.12)  # under way: its first steps are written
                assert h.engine.busy
                if leave == "cancelled":
                    tg.cancel_scope.cancel()
        return got

    [outcome] = anyio.run(main, backend=backend)
    types = [json.loads(line)["type"] for line in log.read_text().splitlines()]
    drivers = {a: os.path.basename(os.readlink(host.device_dir(a) / "driver"))
               for a in (NV, "0000:01:00.1") if (host.device_dir(a) / "driver").is_symlink()}
    if leave == "done":
        assert isinstance(outcome, SwitchCompleted)
        assert types[-1] == "switch-completed"
        assert drivers == {NV: "vfio-pci", "0000:01:00.1": "vfio-pci"}
    else:
        assert outcome == "cancelled"
        assert "switch-failed" in types and "switch-completed" not in types
        assert drivers.get(NV) == "nvidia"


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancelling_at_start_up_and_in_use_leaves_nothing_behind(host: SysRoot,
                                                                 backend: str) -> None:
    async def main() -> None:
        before = open_fds()
        for delay in (0, 0.001, 0.01, 0.05):
            with anyio.move_on_after(delay):
                async with (
                    open_quiet(host.root, "kernel", log=host.root / "events.jsonl") as w,
                    w.subscribe(since_seq=0) as sub,
                ):
                    async for _event in sub:
                        pass
        assert open_fds() == before
        # The log's one-writer lock went with the cancelled watchers.
        async with open_quiet(host.root, log=host.root / "events.jsonl") as w:
            assert w.seq > 0

    anyio.run(main, backend=backend)


# --------------------------------------------------------------------------- exceptions


class BodyError(Exception):
    pass


async def test_an_exception_in_the_body_reaches_the_caller_with_its_cause(host: SysRoot) -> None:
    original = KeyError("the real reason")
    with pytest.raises(BodyError) as info:
        async with open_quiet(host.root):
            try:
                raise original
            except KeyError as exc:
                raise BodyError("wrapped") from exc
    assert info.value.__cause__ is original
    assert not isinstance(info.value, BaseExceptionGroup)


async def test_an_exception_group_raised_in_the_body_stays_a_group(host: SysRoot) -> None:
    with pytest.raises(ExceptionGroup) as info:
        async with open_quiet(host.root):
            raise ExceptionGroup("the caller's own", [BodyError("inner")])
    assert info.value.message == "the caller's own"


async def test_wait_for_on_a_closing_watcher_raises_a_gpuwatch_error(host: SysRoot) -> None:
    errors: list[BaseException] = []

    async def waiter(w: Host, task_status: anyio.abc.TaskStatus[None]) -> None:
        task_status.started()
        try:
            await w.wait_for(lambda e: False)
        except Exception as exc:
            errors.append(exc)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg, open_quiet(host.root) as w:
            await tg.start(waiter, w)
            await anyio.sleep(0.01)
    with anyio.fail_after(5):
        with pytest.raises(gpuwatch.WatcherClosed):
            await w.wait_for(lambda e: True)
    assert len(errors) == 1 and isinstance(errors[0], gpuwatch.WatcherClosed)
    assert isinstance(errors[0], gpuwatch.GpuwatchError)
    assert isinstance(errors[0], anyio.EndOfStream)  # what it raised before: still caught


# --------------------------------------------------------------------------- bad arguments


async def test_subscribe_rejects_unknown_event_types_like_the_socket(host: SysRoot) -> None:
    async with open_quiet(host.root) as w:
        with pytest.raises(gpuwatch.UsageError, match="driver-change'"):
            async with w.subscribe(types={"driver-change"}):
                pass
        with pytest.raises(gpuwatch.UsageError, match="types"):
            async with w.subscribe(types="driver-changed"):  # a bare name is not a set
                pass
        with pytest.raises(gpuwatch.UsageError, match="addrs"):
            async with w.subscribe(addrs=NIC):
                pass
        with pytest.raises(gpuwatch.UsageError, match="not a PCI address"):
            async with w.subscribe(addrs=["01:00.0"]):
                pass
        assert w.watcher._subscribers == []


async def test_wait_for_rejects_an_unknown_type_before_waiting(host: SysRoot) -> None:
    async with open_quiet(host.root) as w:
        with pytest.raises(gpuwatch.UsageError), anyio.fail_after(5):
            await w.wait_for(lambda e: True, types={"no-such-type"})


async def test_subscribe_addrs_are_spelled_like_every_other_addr(host: SysRoot) -> None:
    source = MemorySource()
    async with (
        open_quiet(host.root, source) as w,
        w.subscribe(addrs={"00000000:02:00.0"}) as padded,
        w.subscribe(addrs={NIC.upper()}) as upper,
    ):
        host.unbind(NIC)
        source.push(host.uevent_props("unbind", NIC))
        with anyio.fail_after(5):
            assert (await padded.__anext__()).addr == NIC
            assert (await upper.__anext__()).addr == NIC


@pytest.mark.parametrize("buffer", [0, -1])
async def test_a_buffer_below_one_is_a_usage_error(host: SysRoot, buffer: int) -> None:
    async with open_quiet(host.root) as w:
        with pytest.raises(gpuwatch.UsageError, match="buffer"):
            async with w.subscribe(buffer=buffer):
                pass
    with pytest.raises(gpuwatch.UsageError, match="subscriber_buffer"):
        async with open_quiet(host.root, subscriber_buffer=buffer):
            pass


async def test_a_root_that_is_not_a_directory_is_a_usage_error(tmp_path: Path) -> None:
    source = MemorySource()
    with pytest.raises(gpuwatch.UsageError, match="not a directory"):
        async with open_quiet(tmp_path / "no-such-root", source):
            pass
    with pytest.raises(anyio.ClosedResourceError):
        source.push({"ACTION": "change", "DEVPATH": "/devices/x", "SUBSYSTEM": "pci"})


async def test_resync_with_an_unknown_reason_is_a_usage_error(host: SysRoot) -> None:
    async with open_quiet(host.root) as w:
        with pytest.raises(gpuwatch.UsageError, match="reason"):
            await w.resync("because")
        assert await w.resync("reconcile") == 0


async def test_a_bad_log_size_is_a_usage_error(host: SysRoot) -> None:
    with pytest.raises(gpuwatch.UsageError, match="max_bytes"):
        async with open_quiet(host.root, log=host.root / "events.jsonl", log_max_bytes=0):
            pass
    with pytest.raises(gpuwatch.UsageError, match="keep"):
        async with open_quiet(host.root, log=host.root / "events.jsonl", log_keep=-1):
            pass


@pytest.mark.parametrize(("keyword", "value"), [
    ("log_keep", -1), ("log_keep", 1001), ("log_max_bytes", 0),
    ("reconcile_interval", -1), ("cdi_poll_interval", float("nan")),
    ("vgpu_poll_interval", -5.0), ("vfio_node_poll_interval", float("nan")),
])
async def test_a_bad_setting_is_refused_with_or_without_a_log(host: SysRoot, keyword: str,
                                                              value: float) -> None:
    """What the watcher's keywords refuse, it refuses whether or not a log is given (an
    orchestrator that logs only in production met the error only there), and an interval
    that is negative or NaN is refused as the CLI's settings refuse it, not taken for
    "off" without a word. Was: accepted, and the poll or reconcile silently never ran."""
    source = MemorySource()
    with pytest.raises(gpuwatch.UsageError, match=keyword):
        async with gpuwatch.open_watcher(host.root, source, **{keyword: value}):
            pytest.fail("a refused setting opened the watcher")
    with pytest.raises(anyio.ClosedResourceError):
        source.push(host.uevent_props("change", NIC))  # the source handed in was closed


async def test_the_watcher_probe_takes_a_vendor_like_the_host(host: SysRoot) -> None:
    async with open_quiet(host.root) as w:
        assert isinstance(w, Host)
        assert w.watcher.probe("plan", mode="vfio", vendor="0x10de") == \
            w.probe("plan", mode="vfio", vendor="0x10de")


async def test_entering_a_context_twice_says_so(host: SysRoot) -> None:
    opened = open_quiet(host.root)
    async with opened as w:
        subscribing = w.subscribe()
        async with subscribing:
            pass
        with pytest.raises(gpuwatch.UsageError, match="once"):
            async with subscribing:
                pass
        with pytest.raises(gpuwatch.UsageError, match="once"):
            async with opened:
                pass
    with pytest.raises(gpuwatch.UsageError, match="once"):
        async with opened:
            pass


async def test_a_closed_host_refuses_to_switch_before_writing_anything(host: SysRoot) -> None:
    async with simulated_switch(host) as (h, sim, _engine, _events):
        pass
    for attempt in (lambda: h.switch(NV, "vfio"), lambda: h.recover(NV),
                    lambda: h.resync("reconcile")):
        with pytest.raises(gpuwatch.WatcherClosed, match="closed"), anyio.fail_after(10):
            await attempt()
    assert sim.record == []  # not even the nvidia module unload
    assert h.probe("display-driver", addr=NV) == "nvidia"


# --------------------------------------------------------------------------- threads


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_watcher_used_from_another_threads_loop_is_a_clear_error(host: SysRoot,
                                                                  backend: str) -> None:
    async def main() -> None:
        source = MemorySource()
        async with open_quiet(host.root, source) as w:
            async def subscribe_there() -> None:
                async with w.subscribe():
                    pass

            async def wait_there() -> Any:
                return await w.wait_for(lambda e: True, timeout=5)

            async def resync_there() -> int:
                return await w.resync("reconcile")

            async def switch_there() -> Any:
                return await w.switch(NV, "vfio")

            async with w.subscribe() as sub:
                for call in (subscribe_there, wait_there, resync_there, switch_there):
                    box = await anyio.to_thread.run_sync(run_in_thread, call, backend)
                    assert isinstance(box.get("error"), gpuwatch.UsageError), (call, box)
                    assert "thread" in str(box["error"])
                # The watcher still runs, and its own subscribers still hear events.
                host.unbind(NIC)
                source.push(host.uevent_props("unbind", NIC))
                with anyio.fail_after(5):
                    event = await sub.__anext__()
                assert (event.type, event.addr) == ("driver-changed", NIC)

                async def read_there() -> Any:
                    return await sub.__anext__()

                box = await anyio.to_thread.run_sync(run_in_thread, read_there, backend)
                assert isinstance(box.get("error"), gpuwatch.UsageError), box
            # From a worker thread the loop started, anyio's own bridge is the way in.
            answer = await anyio.to_thread.run_sync(
                lambda: anyio.from_thread.run(w.resync, "reconcile"))
            assert answer == 0

    anyio.run(main, backend=backend)


# --------------------------------------------------------------------------- replays


@pytest.mark.parametrize("leave", ["after-one-chunk", "cancelled-at-once"])
async def test_a_replay_left_before_its_end_lets_go_of_the_log_files_at_once(
        host: SysRoot, monkeypatch: pytest.MonkeyPatch, leave: str) -> None:
    """A subscriber that leaves mid-replay (or is cancelled while the replay opens) closes
    the log reader then, not whenever the garbage collector gets to it: until then its
    files stay open, and a collector that finalises the files first says they leaked."""
    from gpuwatch.watch import watcher as watcher_mod
    from gpuwatch.watch.subscription import REPLAY_CHUNK

    readers: list[Any] = []
    real = watcher_mod.read_records

    def kept(*args: Any, **kwargs: Any) -> Any:
        readers.append(real(*args, **kwargs))
        return readers[-1]

    monkeypatch.setattr(watcher_mod, "read_records", kept)
    log = host.root / "events.jsonl"
    async with open_quiet(host.root, log=log) as w:
        for n in range(REPLAY_CHUNK + 10):
            w.publish([DriverChanged(addr=NIC, old="igb" if n % 2 else "", new="")])
        before = open_fds()
        with anyio.fail_after(10):
            if leave == "after-one-chunk":
                async with w.subscribe(since_seq=0) as sub:
                    first = await sub.__anext__()
                    assert first.seq == 1
            else:
                with anyio.CancelScope() as scope:
                    scope.cancel()
                    async with w.subscribe(since_seq=0):
                        pytest.fail("a cancelled subscribe entered its body")
        assert len(readers) == 1
        assert readers[0].gi_frame is None, "the log reader was left suspended"
        assert open_fds() <= before


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_log_follower_closed_early_lets_go_of_its_files_at_once(host: SysRoot,
                                                                  backend: str) -> None:
    """``afollow_events`` closed after a ``break`` (``contextlib.aclosing``, as trio asks
    of every async generator) closes the follower inside it too: its log files are shut
    when the block ends, and trio finds no generator left unfinished to warn about. Was:
    the inner ``afollow_records`` stayed suspended with the log open until the collector
    came, and trio reported it (a ResourceWarning, an error under a strict filter)."""
    from contextlib import aclosing

    from gpuwatch.watch.eventlog import afollow_events

    log = host.root / "events.jsonl"
    unraisable: list[Any] = []

    async def main() -> None:
        async with open_quiet(host.root, log=log) as w:
            for n in range(5):
                w.publish([DriverChanged(addr=NIC, old="igb" if n % 2 else "", new="")])
            before = open_fds()
            with anyio.fail_after(10):
                async with aclosing(afollow_events(log, poll_interval=0.01)) as events:
                    async for event in events:
                        assert event["seq"] == 1
                        break
            assert open_fds() == before, "the follower kept the log open"
            gc.collect()
            await anyio.sleep(0.05)  # a finaliser the loop runs would run now

    hook = sys.unraisablehook
    sys.unraisablehook = unraisable.append
    try:
        anyio.run(main, backend=backend)
    finally:
        sys.unraisablehook = hook
    assert [str(u.exc_value) for u in unraisable] == []
