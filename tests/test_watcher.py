"""The live watcher: uevents against trees that change under them, exact events, probes after."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from gpuwatch.core.events import DriverChanged
from gpuwatch.sources.memory import MemorySource
from gpuwatch.testing import SysRoot
from gpuwatch.watch.subscription import SubscriberLagged
from gpuwatch.watch.watcher import Watcher, open_watcher

NV, NV_AUDIO, IGPU, NIC = "0000:01:00.0", "0000:01:00.1", "0000:00:02.0", "0000:02:00.0"


class Harness:
    """A watcher over a fixture root fed by a MemorySource, with a subscriber reading all."""

    def __init__(
        self, host: SysRoot, watcher: Watcher, source: MemorySource, events: list[Any]
    ) -> None:
        self.host, self.watcher, self.source, self.events = host, watcher, source, events

    async def send(
        self, action: str, key: str, *, expect: int, **extra: str
    ) -> list[dict[str, Any]]:
        """Push one uevent for ``key`` and return the ``expect`` events it caused (as JSON)."""
        start = len(self.events)
        self.source.push(self.host.uevent_props(action, key, **extra))
        return await self.collect(start, expect)

    async def collect(self, start: int, expect: int) -> list[dict[str, Any]]:
        with anyio.fail_after(5):
            while len(self.events) < start + expect:
                await anyio.sleep(0.005)
        await anyio.sleep(0.05)  # and nothing more arrives
        got = [json.loads(e.model_dump_json()) for e in self.events[start:]]
        assert len(got) == expect, got
        return got


@asynccontextmanager
async def harness_for(host: SysRoot) -> AsyncIterator[Harness]:
    source = MemorySource()
    events: list[Any] = []
    async with open_watcher(host.root, source, reconcile_interval=0, cdi_poll_interval=0.05) as w:
        w.listeners.append(events.append)
        yield Harness(host, w, source, events)


def strip(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in e.items() if k not in ("seq", "time")} for e in events]


async def test_ready_comes_first_with_the_device_count(host: SysRoot) -> None:
    seen: list[Any] = []
    source = MemorySource()
    async with open_watcher(host.root, source, reconcile_interval=0, cdi_poll_interval=0) as w:
        snap = w.snapshot()
        assert snap.seq == 1
        assert len(snap.functions) == len(host.functions)
        async with w.subscribe() as sub:
            source.push(host.uevent_props("change", NIC))
            host.unbind(NIC)
            source.push(host.uevent_props("unbind", NIC))
            with anyio.fail_after(5):
                seen.append(await sub.receive())
    assert seen[0].type == "driver-changed" and seen[0].seq == 2  # the change was silent


async def test_unbind_without_driver_property_uses_the_remembered_driver(host: SysRoot) -> None:
    async with harness_for(host) as harness:
        harness.host.unbind(NIC)
        got = await harness.send("unbind", NIC, expect=1)
        assert "DRIVER" not in harness.host.uevent_props("unbind", NIC)
        assert strip(got) == [{"type": "driver-changed", "addr": NIC, "old": "igb", "new": ""}]
        harness.host.bind(NIC, "vfio-pci")
        got = await harness.send("bind", NIC, expect=1)
        assert strip(got) == [{"type": "driver-changed", "addr": NIC, "old": "", "new": "vfio-pci"}]
        assert harness.watcher.probe("display-driver", addr=NIC) == "vfio-pci"


async def test_gpu_bind_sequence_and_probe_changes(host: SysRoot) -> None:
    async with harness_for(host) as harness:
        h = harness
        h.host.unbind(NV)
        # The only NVIDIA GPU leaves nvidia: detect-gpu turns false with it.
        got = await h.send("unbind", NV, expect=4)
        assert strip(got)[0] == {"type": "driver-changed", "addr": NV, "old": "nvidia", "new": ""}
        assert strip(got)[1] == {"type": "probe-changed", "action": "detect-gpu", "old": True,
                                 "new": False}
        assert got[2]["type"] == "probe-changed" and got[2]["action"] == "detect-vfio"
        # Only the GPU entry that changed, never the whole list; unchanged fields are absent.
        assert [(g["addr"], g["driver"]) for g in got[2]["old"]["gpus"]] == [(NV, "nvidia")]
        assert [(g["addr"], g["driver"]) for g in got[2]["new"]["gpus"]] == [(NV, "")]
        assert set(got[2]["new"]) == {"gpus"}
        assert got[3]["action"] == "detect-host-devices" and got[3]["new"] == {"gpu": False}
        assert got[1]["seq"] == got[0]["seq"] + 1
        h.host.bind(NV, "vfio-pci")
        await h.send("bind", NV, expect=2)
        h.host.unbind(NV_AUDIO)
        h.host.bind(NV_AUDIO, "vfio-pci")
        await h.send("bind", NV_AUDIO, expect=2)
        assert h.watcher.probe("group-in-mode", addr=NV, mode="vfio") is True
        assert h.watcher.probe("current-mode", addr=NV) == "vfio"


async def test_change_on_unchanged_device_is_silent(host: SysRoot) -> None:
    async with harness_for(host) as harness:
        await harness.send("change", NV, expect=0)
        await harness.send("frobnicate", NV, expect=0)  # unknown action: treated like change


@pytest.mark.parametrize("devpath", ["", "/", "/devices/pci0000:00/"])
@pytest.mark.parametrize("action", ["", "add", "change", "bind"])
async def test_a_pci_line_naming_no_device_adds_none(
    host: SysRoot, action: str, devpath: str
) -> None:
    """A hand-written (``file:``) line whose DEVPATH names no device, with no PCI_SLOT_NAME,
    must not add a function with the address ``""`` (whose read of the bus directory itself
    made it look present)."""
    async with harness_for(host) as harness:
        before = dict(harness.watcher.model.state.functions)
        start = len(harness.events)
        harness.source.push({"ACTION": action, "DEVPATH": devpath, "SUBSYSTEM": "pci"})
        harness.source.push(host.uevent_props("change", NIC))  # a marker: the line is done
        await harness.collect(start, 0)
        assert "" not in harness.watcher.model.state.functions
        assert harness.watcher.model.state.functions.keys() == before.keys()


async def test_unknown_action_still_reads_the_tree(host: SysRoot) -> None:
    async with harness_for(host) as harness:
        harness.host.bind(NIC, "vfio-pci")
        got = await harness.send("online", NIC, expect=1)
        assert strip(got) == [
            {"type": "driver-changed", "addr": NIC, "old": "igb", "new": "vfio-pci"}
        ]


async def test_group_move_is_seen_on_the_next_event(host: SysRoot) -> None:
    async with harness_for(host) as harness:
        harness.host.set_iommu_group(NV_AUDIO, 21)  # no uevent for groups: only re-reading finds it
        got = await harness.send("change", NV_AUDIO, expect=2)
        assert strip(got)[0] == {
            "type": "iommu-group-changed",
            "addr": NV_AUDIO,
            "old": 13,
            "new": 21,
        }
        assert got[1]["action"] == "detect-vfio"
        gpu = next(g for g in harness.watcher.probe("detect-vfio").gpus if g.addr == NV)
        assert [m.addr for m in gpu.group_members] == [NV]


async def test_add_and_remove(host: SysRoot) -> None:
    async with harness_for(host) as harness:
        h = harness
        h.host.add_function(
            "0000:05:00.0",
            vendor="0x8086",
            device="0x10fb",
            klass="0x020000",
            driver="ixgbe",
            iommu_group=30,
        )
        got = await h.send("add", "0000:05:00.0", expect=1)
        assert got[0]["type"] == "device-added"
        assert got[0]["device"] == {
            "addr": "0000:05:00.0",
            "vendor_id": "0x8086",
            "device_id": "0x10fb",
            "class": "0x0200",
            "class_label": "0x0200",
            "driver": "ixgbe",
            "iommu_group": 30,
            "vfio_dev": "",
            "vfio_cdev": "",
            "sriov": None,
            "physfn": "",
            "vgpu": None,
            "health": "ok",
        }
        h.host.remove_function("0000:05:00.0")
        got = await h.send("remove", "0000:05:00.0", expect=1)
        assert strip(got) == [
            {"type": "device-removed", "addr": "0000:05:00.0", "device": got[0]["device"]}
        ]
        assert got[0]["device"]["driver"] == "ixgbe"  # as it was last known


async def test_remove_word_for_a_device_still_present_removes_nothing(host: SysRoot) -> None:
    async with harness_for(host) as harness:
        await harness.send("remove", NIC, expect=0)  # sysfs is the truth, the action only a hint
        assert harness.watcher.probe("display-driver", addr=NIC) == "igb"


async def test_device_vanished_before_the_read_is_a_removal(host: SysRoot) -> None:
    async with harness_for(host) as harness:
        props = harness.host.uevent_props("change", NIC)
        harness.host.remove_function(NIC)
        start = len(harness.events)
        harness.source.push(props)
        got = await harness.collect(start, 1)
        assert got[0]["type"] == "device-removed"


async def test_gpu_removal_takes_its_drm_nodes_and_render_node(host: SysRoot) -> None:
    async with harness_for(host) as harness:
        h = harness
        start = len(h.events)
        for name in ("card1", "renderD129"):
            props = h.host.uevent_props("remove", h.watcher.model.state.drm[name].devpath)
            h.host.remove_drm(name)
            h.source.push(props)
        got = await h.collect(start, 2)
        assert [e["type"] for e in got] == ["node-removed", "probe-changed"]
        assert got[1]["action"] == "detect-host-devices"
        assert got[0]["path"] == "/dev/dri/renderD129"
        assert h.watcher.probe("detect-host-devices").render_node == "/dev/dri/renderD128"


async def test_vfio_node_and_module_events(host: SysRoot) -> None:
    async with harness_for(host) as harness:
        h = harness
        h.host.add_vfio_group(13, mode=0o660)
        got = await h.send("add", "/devices/virtual/vfio/13", expect=1)
        assert strip(got) == [{"type": "node-added", "path": "/dev/vfio/13"}]
        assert h.watcher.probe("vfio-group-accessible", group=13) is True
        props = h.host.uevent_props("remove", "/module/nvidia")
        h.host.remove_module("nvidia")
        start = len(h.events)
        h.source.push(props)
        got = await h.collect(start, 2)
        assert (got[0]["action"], got[0]["old"], got[0]["new"]) == ("detect-gpu", True, False)
        assert got[1]["action"] == "detect-host-devices" and got[1]["new"]["gpu"] is False


async def test_cdi_spec_appearing_is_seen_without_a_uevent(host: SysRoot) -> None:
    async with harness_for(host) as harness:
        h = harness
        h.host.remove_cdi_spec("etc")
        start = len(h.events)
        with anyio.fail_after(1):
            got = await h.collect(start, 2)
        assert (got[0]["action"], got[0]["new"]) == ("detect-gpu", False)
        h.host.add_cdi_spec("var")
        with anyio.fail_after(1):
            await h.collect(start + 2, 2)
        assert h.watcher.probe("detect-gpu") is True


async def test_overflow_rescans_and_emits_the_drift_then_resync(host: SysRoot) -> None:
    async with harness_for(host) as harness:
        h = harness
        h.host.unbind(NIC)  # changes whose events were "lost"
        h.host.add_function(
            "0000:06:00.0", klass="0x010802", vendor="0x144d", driver="nvme", iommu_group=40
        )
        start = len(h.events)
        h.source.overflow()
        got = await h.collect(start, 3)
        assert sorted(e["type"] for e in got[:2]) == ["device-added", "driver-changed"]
        assert strip(got[2:]) == [{"type": "resync", "reason": "overflow", "changes": 2}]
        # and the watcher goes on
        h.host.bind(NIC, "igb")
        await h.send("bind", NIC, expect=1)


async def test_reconcile_finds_drift(host: SysRoot) -> None:
    source = MemorySource()
    async with (
        open_watcher(host.root, source, reconcile_interval=0.2, cdi_poll_interval=0) as w,
        w.subscribe(types={"driver-changed", "resync"}) as sub,
    ):
        host.unbind(NIC)
        with anyio.fail_after(5):
            first, second = await sub.receive(), await sub.receive()
    assert (first.type, first.addr, first.new) == ("driver-changed", NIC, "")
    assert (second.type, second.reason, second.changes) == ("resync", "reconcile", 1)


# --------------------------------------------------------------------------- subscribers


async def toggle_nic(host: SysRoot, source: MemorySource, live: Any,
                     times: int) -> list[Any]:
    """Unbind and rebind the NIC by turns, ``times`` uevents, each awaited on ``live``."""
    got = []
    for i in range(times):
        if i % 2 == 0:
            host.unbind(NIC)
        else:
            host.bind(NIC, "igb")
        source.push(host.uevent_props("change", NIC))
        with anyio.fail_after(5):
            got.append(await live.receive())
    return got


async def test_stalled_subscriber_does_not_hold_up_a_live_one(host: SysRoot) -> None:
    source = MemorySource()
    async with open_watcher(host.root, source, reconcile_interval=0, cdi_poll_interval=0) as w:
        async with (
            w.subscribe(types={"driver-changed"}, buffer=3) as stalled,
            w.subscribe(types={"driver-changed"}) as live,
        ):
            got = await toggle_nic(host, source, live, 10)
            assert [e.new for e in got] == ["", "igb"] * 5
            drained = [await stalled.receive() for _ in range(3)]
            assert [e.seq for e in drained] == [e.seq for e in got[:3]]
            with pytest.raises(SubscriberLagged) as info:
                await stalled.receive()
            assert info.value.missed == 7
            # Where to resume: the first event it never got, the fourth the live one got.
            assert info.value.first_missed_seq == got[3].seq
            assert f"since_seq={got[2].seq}" in str(info.value)
        assert w.snapshot().functions  # the model kept going


async def test_a_lagged_subscriber_resumes_where_it_lost_events(host: SysRoot,
                                                                 tmp_path: Path) -> None:
    """The live lag names the first event dropped; resubscribing just before it replays
    exactly the dropped ones from the log, then goes on live."""
    source = MemorySource()
    log = tmp_path / "events.jsonl"
    async with open_watcher(host.root, source, log=str(log), reconcile_interval=0,
                            cdi_poll_interval=0) as w:
        async with (
            w.subscribe(types={"driver-changed"}, buffer=2) as slow,
            w.subscribe(types={"driver-changed"}) as live,
        ):
            got = await toggle_nic(host, source, live, 6)
            kept = [(await slow.receive()).seq for _ in range(2)]
            with pytest.raises(SubscriberLagged) as info:
                await slow.receive()
        first = info.value.first_missed_seq
        assert kept == [e.seq for e in got[:2]] and first == got[2].seq
        async with w.subscribe(types={"driver-changed"}, since_seq=first - 1) as again:
            with anyio.fail_after(5):
                replayed = [await again.receive() for _ in range(4)]
            assert again.complete
        assert [(e.seq, e.new) for e in replayed] == [(e.seq, e.new) for e in got[2:]]


async def test_filters_by_type_and_addr(host: SysRoot) -> None:
    async with harness_for(host) as harness:
        h = harness
        async with h.watcher.subscribe(addrs=[NV_AUDIO]) as audio:
            h.host.unbind(NIC)
            h.source.push(h.host.uevent_props("unbind", NIC))
            h.host.unbind(NV_AUDIO)
            h.source.push(h.host.uevent_props("unbind", NV_AUDIO))
            with anyio.fail_after(5):
                event = await audio.receive()
        assert (event.type, event.addr) == ("driver-changed", NV_AUDIO)


async def test_wait_for_and_its_timeout(host: SysRoot) -> None:
    async with harness_for(host) as harness:
        h = harness

        async def later() -> None:
            await anyio.sleep(0.05)
            h.host.bind(NIC, "vfio-pci")
            h.source.push(h.host.uevent_props("bind", NIC))

        async with anyio.create_task_group() as tg:
            tg.start_soon(later)
            event = await h.watcher.wait_for(
                lambda e: isinstance(e, DriverChanged) and e.new == "vfio-pci", timeout=5
            )
        assert event.addr == NIC
        with pytest.raises(TimeoutError):
            await h.watcher.wait_for(lambda e: False, timeout=0.1)


async def test_cancelling_a_waiting_subscriber_is_clean(host: SysRoot) -> None:
    async with harness_for(host) as harness:
        async with harness.watcher.subscribe() as sub:
            with anyio.move_on_after(0.1) as scope:
                await sub.receive()
            assert scope.cancelled_caught
        assert harness.watcher._subscribers == []


async def test_closing_the_watcher_ends_iteration(host: SysRoot) -> None:
    source = MemorySource()
    received: list[Any] = []
    ended = anyio.Event()

    async def reader(w: Watcher, task_status: anyio.abc.TaskStatus[None]) -> None:
        async with w.subscribe() as sub:
            task_status.started()
            async for event in sub:
                received.append(event)
        ended.set()

    async with anyio.create_task_group() as tg:
        async with open_watcher(host.root, source, reconcile_interval=0, cdi_poll_interval=0) as w:
            await tg.start(reader, w)
        with anyio.fail_after(2):
            await ended.wait()
    assert received == []


async def test_file_source_end_sets_source_ended(host: SysRoot, tmp_path: Path) -> None:
    fifo = tmp_path / "events.fifo"
    os.mkfifo(fifo)
    async with open_watcher(
        host.root, f"file:{fifo}", reconcile_interval=0, cdi_poll_interval=0
    ) as w:
        host.unbind(NIC)

        def write() -> None:
            with open(fifo, "w") as fh:
                fh.write(json.dumps(host.uevent_props("unbind", NIC)) + "\n")

        await anyio.to_thread.run_sync(write)
        with anyio.fail_after(5):
            await w.source_ended.wait()
        assert w.probe("display-driver", addr=NIC) == ""
        assert w.seq == 2


async def test_source_warnings_are_logged(host: SysRoot, caplog: pytest.LogCaptureFixture) -> None:
    source = MemorySource()
    source.warnings.append("kernel uevent source is silent inside a user namespace")
    with caplog.at_level(logging.WARNING, logger="gpuwatch.watch"):
        async with open_watcher(host.root, source, reconcile_interval=0, cdi_poll_interval=0):
            pass
    assert "user namespace" in caplog.text


# --------------------------------------------------------------------------- the log


async def test_log_holds_every_event_and_seq_continues_after_restart(
    host: SysRoot, tmp_path: Path
) -> None:
    log = tmp_path / "events.jsonl"
    for round_ in range(2):
        source = MemorySource()
        async with open_watcher(
            host.root, source, log=log, reconcile_interval=0, cdi_poll_interval=0
        ) as w:
            host.unbind(NIC) if round_ == 0 else host.bind(NIC, "igb")
            source.push(host.uevent_props("change", NIC))
            with anyio.fail_after(5):
                while w.seq < (2 if round_ == 0 else 4):
                    await anyio.sleep(0.01)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["seq"], e["type"]) for e in lines] == [
        (1, "ready"),
        (2, "driver-changed"),
        (3, "ready"),
        (4, "driver-changed"),
    ]
    assert all(e["time"].endswith("Z") and len(e["time"]) == 27 for e in lines)


async def test_a_periodic_poll_that_wakes_as_the_context_closes_ends_quietly(
    host: SysRoot,
) -> None:
    """The vGPU poll and the reconcile sleep, then act. A sleep that ends in the same turn
    as the context is left resumes with the watcher already closed, before the cancel
    reaches it: acting then raised WatcherClosed out of ``open_watcher`` (exit 1 for a
    ``gpuwatch watch`` stopped by SIGTERM). Here the turn is made certain: the loops run
    once more on a closed watcher, with no wait."""
    async with open_watcher(host.root, source=MemorySource(), reconcile_interval=0,
                            vgpu_poll_interval=0) as w:
        pass
    with anyio.fail_after(10):
        await w._poll_vgpu()
        await w._reconcile()
    assert w.resyncs == 0


async def test_an_overflow_read_as_the_context_closes_ends_the_pump_quietly(
    host: SysRoot,
) -> None:
    """The same turn for the pump: an overflow batch handed over as the watcher closes went
    on to a resync, which raised WatcherClosed out of ``open_watcher``. Made certain here: the
    pump runs once more on a closed watcher whose source holds an overflow."""
    async with open_watcher(host.root, source=MemorySource(), reconcile_interval=0) as w:
        pass
    late = MemorySource()
    late.overflow()
    late.end()
    w.source = late
    try:
        with anyio.fail_after(10):
            await w._pump()
    finally:
        late.close()
    assert w.resyncs == 0
    assert w.source_ended.is_set()


async def test_a_gpu_bound_to_a_driver_whose_name_is_not_utf8_is_logged(
    host: SysRoot, tmp_path: Path
) -> None:
    """A crafted tree may name a driver with any bytes: binding the GPU to it changes the
    ``detect-vfio`` answer, whose probe-changed line has a fast path of its own. That path
    falls back to the written-as-U+FFFD form too, instead of stopping the watcher."""
    from gpuwatch.watch.eventlog import read_events

    log = tmp_path / "events.jsonl"
    source = MemorySource()
    async with open_watcher(host.root, source, log=log, reconcile_interval=0,
                            cdi_poll_interval=0) as w:
        host.unbind(NV)
        link = host.root / "sys/bus/pci/devices" / NV / "driver"
        os.symlink(b"../../../bus/pci/drivers/nvid\xffia", bytes(link))
        before = w.seq
        source.push(host.uevent_props("bind", NV))
        with anyio.fail_after(10):
            while w.seq < before + 2:
                await anyio.sleep(0.01)
    events = list(read_events(log))
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    changed = [e for e in events if e["type"] == "probe-changed"
               and e["action"] == "detect-vfio"]
    assert changed and "nvid\ufffdia" in json.dumps(changed[-1], ensure_ascii=False)
