"""The events a subscriber acts on say exactly what happened, once: checked against the tree
as the kernel leaves it and against a fresh scan of it (`gpuwatch.model.scan`).

- A ``bind`` or ``unbind`` uevent whose read finds the device already gone (a surprise
  removal right behind it) is a removal, as docs/events.md says of any vanished device: a
  ``device-removed``, not a ``driver-changed`` to ``""`` that leaves a function in the model
  (and in its group's GPU entries) which the tree no longer has.
- A rescan that finds a function newly on vfio-pci reports its VFIO device and cdev in one
  ``device-changed``, as the uevents of that bind do, not two of which the first shows a
  state (``vfio_dev`` without its ``vfio_cdev``) that the scanned tree never had.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
from watch_helpers import watching

from gpuwatch.model import WATCHED_PROBES
from gpuwatch.model import scan as fresh_scan
from gpuwatch.testing import SysRoot

pytestmark = pytest.mark.timeout(60)

NV, AUDIO, NIC = "0000:01:00.0", "0000:01:00.1", "0000:02:00.0"


def plain(event: Any) -> dict[str, Any]:
    """An event as its JSON line says it, less ``seq`` and ``time``."""
    line = json.loads(event.model_dump_json())
    return {k: v for k, v in line.items() if k not in ("seq", "time")}


async def settled(got: list[Any], start: int, expect: int) -> list[dict[str, Any]]:
    """The events from ``start`` once ``expect`` of them came, and nothing more for 50 ms."""
    with anyio.fail_after(5):
        while len(got) < start + expect:
            await anyio.sleep(0.005)
    await anyio.sleep(0.05)
    return [plain(e) for e in got[start:]]


def assert_as_fresh(host: SysRoot, watcher: Any) -> None:
    """The watcher's functions and watched answers are a fresh scan's."""
    fresh = fresh_scan(host.root)
    assert ({f.addr: f for f in watcher.model.functions()}
            == {f.addr: f for f in fresh.functions()})
    for action in WATCHED_PROBES:
        assert watcher.probe(action) == fresh.probe(action), action


@pytest.mark.parametrize("addr", [NIC, AUDIO])
@pytest.mark.parametrize("action", ["bind", "unbind"])
async def test_a_driver_uevent_read_after_the_device_went_is_its_removal(
    host: SysRoot, action: str, addr: str
) -> None:
    async with watching(host) as (w, source, got):
        if action == "unbind":
            host.unbind(addr)
        props = host.uevent_props(action, addr)
        host.remove_function(addr)  # gone before the watcher reads it
        start = len(got)
        source.push(props)
        events = await settled(got, start, 1)
        assert events[0]["type"] == "device-removed" and events[0]["addr"] == addr
        assert not [e for e in events if e["type"] == "driver-changed"], events
        assert addr not in w.model.state.functions
        assert_as_fresh(host, w)
        if addr == AUDIO:  # the GPU's entry no longer lists it among its group's members
            gpu = next(g for g in w.probe("detect-vfio").gpus if g.addr == NV)
            assert [m.addr for m in gpu.group_members] == [NV]
        # The remove uevent that follows finds nothing left to report.
        start = len(got)
        source.push(host.uevent_props("remove", addr))
        assert await settled(got, start, 0) == []


async def test_a_rescan_reports_a_new_vfio_device_and_its_cdev_in_one_change(
    host: SysRoot,
) -> None:
    async with watching(host) as (w, _source, got):
        # The group moves to vfio-pci with every uevent lost: only the rescan sees it.
        for name in ("card1", "renderD129"):
            host.remove_drm(name)
        for index, addr in enumerate((NV, AUDIO)):
            host.unbind(addr)
            host.bind(addr, "vfio-pci")
            host.add_vfio_dev(addr, index)
        host.add_vfio_group(13)
        start = len(got)
        await w.resync("reconcile")
        events = await settled(got, start, 1)
        for index, addr in enumerate((NV, AUDIO)):
            changed = [e for e in events if e["type"] == "device-changed" and e["addr"] == addr]
            assert len(changed) == 1, changed
            assert changed[0]["changed"] == ["vfio_dev", "vfio_cdev"]
            assert changed[0]["device"]["vfio_dev"] == f"vfio{index}"
            assert changed[0]["device"]["vfio_cdev"] == f"/dev/vfio/devices/vfio{index}"
        added = [e["path"] for e in events if e["type"] == "node-added"]
        assert sorted(added) == ["/dev/vfio/13", "/dev/vfio/devices/vfio0",
                                 "/dev/vfio/devices/vfio1"]
        assert events[-1] == {"type": "resync", "reason": "reconcile",
                              "changes": len(events) - 1}
        assert_as_fresh(host, w)
        # And back without uevents: the cdev goes with its function's record, in one change.
        for addr in (NV, AUDIO):
            host.unbind(addr)  # (takes its vfio-dev entry and cdev node along)
        host.remove_vfio_group(13)
        start = len(got)
        await w.resync("reconcile")
        events = await settled(got, start, 1)
        for addr in (NV, AUDIO):
            changed = [e for e in events if e["type"] == "device-changed" and e["addr"] == addr]
            assert [e["changed"] for e in changed] == [["vfio_dev", "vfio_cdev"]]
        assert_as_fresh(host, w)
