"""SR-IOV VFs and NVIDIA vGPU VFs coming and going in bursts, the watcher's model checked
against a fresh scan of the tree after each burst, and the events against what changed.

- A PF re-read while the first VF's ``add`` is read names every VF the kernel had added by
  then. When ``sriov_numvfs`` goes back to 0 before the others' ``add`` is read, those VFs
  are never in the model, and their removal must still take them out of the PF's list, or
  the PF keeps naming VFs the tree no longer has (a fresh scan lists none).
- An mdev vGPU's emulated-IOMMU group comes and goes with no uevent of its own: on a host
  without an IOMMU it is the only group, and detect-vfio's ``iommu_enabled`` follows it.
- The vGPU poll re-reads ``nvidia/current_vgpu_type`` without a uevent. A batch applied
  between its read and its apply (the VF unbound from nvidia) must not be overwritten with
  what the files said before it: a vGPU on a function no driver holds.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from test_event_exactness import assert_as_fresh, settled
from watch_helpers import watching

from gpuwatch.testing.modern import SRIOV_PF, VGPU_TYPES, add_vfs, sriov_gpu_host
from gpuwatch.testing.sysroot import Layout, SysRoot
from gpuwatch.watch import watcher as watcher_mod

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("layout", ["symlink", "flat"])
async def test_vfs_gone_before_their_add_was_read_leave_the_pf(
    tmp_path: Path, layout: Layout
) -> None:
    host = sriov_gpu_host(tmp_path, layout=layout)
    async with watching(host) as (w, source, got):
        vfs = add_vfs(host, 3)
        # Only the first VF's add is read while the VFs are there: the PF, re-read with it,
        # names all three; the model holds the first.
        start = len(got)
        source.push(host.uevent_props("add", vfs[0]))
        events = await settled(got, start, 3)
        assert [(e["type"], e.get("addr")) for e in events] == [
            ("device-added", vfs[0]), ("device-changed", SRIOV_PF), ("probe-changed", None)]
        assert events[1]["device"]["sriov"]["vfs"] == vfs
        assert vfs[1] not in w.model.state.functions  # (its own add not read yet)
        # echo 0 > sriov_numvfs before the other adds were read: every event of the burst
        # is read after the VFs went.
        props = [host.uevent_props("add", vf) for vf in vfs[1:]]
        gone = host.remove_vfs(SRIOV_PF)
        props += [host.uevent_props("remove", vf) for vf in gone]
        start = len(got)
        for p in props:
            source.push(p)
        events = await settled(got, start, 1)
        assert_as_fresh(host, w)
        pf = w.model.function(SRIOV_PF)
        assert pf.sriov is not None and (pf.sriov.numvfs, pf.sriov.vfs) == (0, ())
        removed = [e["addr"] for e in events if e["type"] == "device-removed"]
        assert removed == [vfs[0]]  # the only one the model held
        changes = [e["device"]["sriov"]["vfs"] for e in events
                   if e["type"] == "device-changed" and e["addr"] == SRIOV_PF]
        assert changes and changes[-1] == []
        detect = w.probe("detect-vfio")
        assert [g.addr for g in detect.gpus] == [SRIOV_PF]
        assert detect.gpus[0].sriov is not None and detect.gpus[0].sriov.vfs == ()


async def test_a_vf_that_comes_back_in_another_group_moves_in_one_batch(tmp_path: Path) -> None:
    """Off and on again in one burst: the VFs' groups are new ones; each VF that stays in
    the model says its group moved, and the model is a fresh scan's."""
    host = sriov_gpu_host(tmp_path, vfs=2)
    async with watching(host) as (w, source, got):
        props = [host.uevent_props("remove", vf) for vf in host.remove_vfs(SRIOV_PF)]
        again = host.add_vfs(SRIOV_PF, 2, first_group=60)
        props += [host.uevent_props("add", vf) for vf in again]
        start = len(got)
        for p in props:
            source.push(p)
        events = await settled(got, start, 1)
        assert_as_fresh(host, w)
        moves = {e["addr"]: (e["old"], e["new"]) for e in events
                 if e["type"] == "iommu-group-changed"}
        assert moves == {"0000:41:00.4": (41, 60), "0000:41:00.5": (42, 61)}


async def test_a_vgpu_poll_read_before_an_unbind_does_not_undo_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = sriov_gpu_host(tmp_path, vfs=2, vgpu=True)
    vf = "0000:41:00.4"
    async with watching(host) as (w, source, got):
        host.set_vgpu(vf, 1156, VGPU_TYPES)  # a VM's vGPU type chosen: no uevent
        real = watcher_mod.read_vgpus
        unbound = threading.Event()

        def read_then_unbind(*args: Any) -> Any:
            """The poll's read, then the VF let go of by nvidia (its uevent sent) before the
            read is applied; waits a while for the pump to apply it, as it can when the
            poll's read does not hold the pump off."""
            seen = real(*args)
            host.unbind(vf)
            anyio.from_thread.run_sync(source.push, host.uevent_props("unbind", vf))
            until = time.monotonic() + 0.5
            while time.monotonic() < until and w.model.state.functions[vf].driver:
                time.sleep(0.005)
            unbound.set()
            return seen

        monkeypatch.setattr(watcher_mod, "read_vgpus", read_then_unbind)
        start = len(got)
        await w.poll_vgpus()
        assert unbound.is_set()
        events = await settled(got, start, 1)
        assert_as_fresh(host, w)
        fn = w.model.function(vf)
        assert (fn.driver, fn.vgpu) == ("", None)
        mine = [(e["type"], e.get("vgpu")) for e in events if e.get("addr") == vf]
        # Whatever the poll said first, the last word on the VF's vGPU is that it has none.
        assert mine[-1] == ("vgpu-changed", None), mine
        assert ("driver-changed", None) in mine


# --------------------------------------------------------------------------- mediated vGPUs

MDEV = "a297db4a-f4c2-11e6-90f6-d3b88d6c9525"
IGPU = "0000:00:02.0"


def _create_mdev(host: SysRoot, group: int) -> str:
    """What writing a UUID to ``mdev_supported_types/<type>/create`` leaves once its driver
    bound: the mdev under its parent, the emulated-IOMMU group VFIO made for it (named
    ``vfio-noiommu``, no uevent of its own) and its node ``/dev/vfio/N`` (whose uevent the
    sources follow; the ``mdev`` subsystem's they do not). Returns the node's devpath."""
    mdev = host.root / f"sys/devices/pci0000:00/{IGPU}/{MDEV}"
    mdev.mkdir()
    (mdev / "uevent").write_text("MDEV_TYPE=i915-GVTg_V5_4\n")
    gdir = host.root / f"sys/kernel/iommu_groups/{group}"
    (gdir / "devices").mkdir(parents=True)
    (gdir / "name").write_text("vfio-noiommu\n")
    (mdev / "iommu_group").symlink_to(f"../../../kernel/iommu_groups/{group}")
    (gdir / "devices" / MDEV).symlink_to(f"../../../../devices/pci0000:00/{IGPU}/{MDEV}")
    return host.add_vfio_group(group)


def _remove_mdev(host: SysRoot, group: int) -> None:
    """Writing 1 to the mdev's ``remove``: its node, group and folder go."""
    host.remove_vfio_group(group)
    shutil.rmtree(host.root / f"sys/kernel/iommu_groups/{group}")
    shutil.rmtree(host.root / f"sys/devices/pci0000:00/{IGPU}/{MDEV}")


async def test_an_mdev_vgpus_group_on_a_host_without_an_iommu_is_seen(tmp_path: Path) -> None:
    """No IOMMU, an Intel GVT-g vGPU created and removed: its group is the host's only one,
    so detect-vfio's ``iommu_enabled`` (a group exists) follows it, as a fresh scan says."""
    host = SysRoot(tmp_path)
    host.add_function(IGPU, vendor="0x8086", device="0x3e92", klass="0x030000", driver="i915",
                      subsystem_vendor="0x8086")
    async with watching(host) as (w, source, got):
        assert w.probe("detect-vfio").iommu_enabled is False
        devpath = _create_mdev(host, 0)
        start = len(got)
        source.push(host.uevent_props("add", devpath))
        events = await settled(got, start, 2)
        assert [e["type"] for e in events] == ["node-added", "probe-changed"]
        assert events[1]["action"] == "detect-vfio"
        assert events[1]["new"]["iommu_enabled"] is True
        assert_as_fresh(host, w)
        _remove_mdev(host, 0)
        start = len(got)
        source.push(host.uevent_props("remove", devpath))
        events = await settled(got, start, 2)
        assert [e["type"] for e in events] == ["node-removed", "probe-changed"]
        assert events[1]["new"]["iommu_enabled"] is False
        assert_as_fresh(host, w)
