"""Issue 15's model: VFIO cdev/iommufd fields, vfio-backend, SR-IOV/vGPU, health from uevents.

Trees are built as the kernel lays them out (gpuwatch.testing.modern); uevents are pushed
into a MemorySource as the kernel would send them, after the tree changed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

import gpuwatch
from gpuwatch.core.plan import unhealthy_reason
from gpuwatch.hostfs.facts import health_facts
from gpuwatch.testing import SysRoot, example_gpu_host
from gpuwatch.testing.modern import (
    GH_ADDR,
    SRIOV_PF,
    VGPU_TYPES,
    add_vfs,
    grace_hopper_host,
    sriov_gpu_host,
)
from gpuwatch.testing.sysroot import copy_attr
from tests.test_watcher import harness_for, strip

NV = "0000:01:00.0"
CARD1 = "/devices/pci0000:00/0000:00:01.0/0000:01:00.0/drm/card1"


def fn_json(model: gpuwatch.HostModel, addr: str) -> dict[str, Any]:
    return json.loads(model.function(addr).model_dump_json())


# --------------------------------------------------------------------------- scans


def test_grace_hopper_function_on_a_variant_with_cdev_and_iommufd(tmp_path: Path) -> None:
    grace_hopper_host(tmp_path)
    model = gpuwatch.scan(tmp_path)
    fn = fn_json(model, GH_ADDR)
    assert fn["driver"] == "nvgrace_gpu_vfio_pci"
    assert fn["vfio_dev"] == "vfio0"
    assert fn["vfio_cdev"] == "/dev/vfio/devices/vfio0"
    assert (fn["sriov"], fn["physfn"], fn["vgpu"], fn["health"]) == (None, "", None, "ok")
    vfio = model.probe("detect-vfio")
    assert vfio.iommufd is True and vfio.iommu_kind == "arm"
    gpu = json.loads(vfio.model_dump_json())["gpus"][0]
    assert gpu["vfio_cdev"] == "/dev/vfio/devices/vfio0"
    assert gpu["group_members"][0]["vfio_dev"] == "vfio0"
    backend = model.probe("vfio-backend", addr=GH_ADDR).model_dump()
    assert backend == {"addr": GH_ADDR, "driver": "nvgrace_gpu_vfio_pci", "on_vfio": True,
                       "group_node": "/dev/vfio/19", "cdev_node": "/dev/vfio/devices/vfio0",
                       "iommufd": True, "recommended": "iommufd"}
    assert model.probe("group-in-mode", addr=GH_ADDR, mode="vfio") is True
    assert model.probe("group-in-mode", addr=GH_ADDR, mode="nvidia") is False
    assert model.probe("current-mode", addr=GH_ADDR) == "vfio"


def test_kernel_without_the_cdev_has_vfio_dev_but_no_cdev(tmp_path: Path) -> None:
    grace_hopper_host(tmp_path, cdev=False)
    model = gpuwatch.scan(tmp_path)
    fn = fn_json(model, GH_ADDR)
    assert (fn["vfio_dev"], fn["vfio_cdev"]) == ("vfio0", "")
    backend = model.probe("vfio-backend", addr=GH_ADDR)
    assert (backend.cdev_node, backend.iommufd, backend.recommended) == ("", True, "group")


def test_cdev_without_iommufd_recommends_the_group(tmp_path: Path) -> None:
    grace_hopper_host(tmp_path, iommufd=False)
    model = gpuwatch.scan(tmp_path)
    assert model.probe("detect-vfio").iommufd is False
    backend = model.probe("vfio-backend", addr=GH_ADDR)
    assert (backend.cdev_node, backend.recommended) == ("/dev/vfio/devices/vfio0", "group")


def test_cdev_named_in_sysfs_but_node_missing_is_not_reported(tmp_path: Path) -> None:
    host = grace_hopper_host(tmp_path)
    host.remove_dev_node("/dev/vfio/devices/vfio0")
    model = gpuwatch.scan(tmp_path)
    assert fn_json(model, GH_ADDR)["vfio_cdev"] == ""
    assert model.probe("vfio-backend", addr=GH_ADDR).recommended == "group"


def test_function_off_vfio_has_nothing_to_offer(tmp_path: Path) -> None:
    grace_hopper_host(tmp_path, bound=False)
    model = gpuwatch.scan(tmp_path)
    backend = model.probe("vfio-backend", addr=GH_ADDR).model_dump()
    assert backend == {"addr": GH_ADDR, "driver": "nvidia", "on_vfio": False, "group_node": "",
                       "cdev_node": "", "iommufd": True, "recommended": "none"}
    with pytest.raises(gpuwatch.DeviceNotFound):
        model.probe("vfio-backend", addr="0000:09:00.0")
    with pytest.raises(gpuwatch.UsageError):
        model.probe("vfio-backend")


def test_sriov_pf_and_vfs_fields(tmp_path: Path) -> None:
    sriov_gpu_host(tmp_path, vfs=3)
    model = gpuwatch.scan(tmp_path)
    pf = fn_json(model, SRIOV_PF)
    assert pf["sriov"] == {"totalvfs": 16, "numvfs": 3,
                           "vfs": ["0000:41:00.4", "0000:41:00.5", "0000:41:00.6"]}
    assert pf["physfn"] == ""
    vf = fn_json(model, "0000:41:00.5")
    assert (vf["physfn"], vf["sriov"], vf["iommu_group"]) == (SRIOV_PF, None, 42)
    gpus = [g.addr for g in model.probe("detect-vfio").gpus]
    assert gpus == [SRIOV_PF, "0000:41:00.4", "0000:41:00.5", "0000:41:00.6"]
    assert [m.addr for m in model.state.group_members("0000:41:00.5")] == ["0000:41:00.5"]
    # A function that is no PF has no sriov entry at all.
    assert fn_json(model, "0000:40:01.0")["sriov"] is None


def test_virtfn_order_is_numeric_not_lexical(tmp_path: Path) -> None:
    sriov_gpu_host(tmp_path, vfs=12)
    vfs = gpuwatch.scan(tmp_path).function(SRIOV_PF).sriov
    assert vfs is not None and vfs.numvfs == 12
    assert vfs.vfs[9:11] == ("0000:41:01.5", "0000:41:01.6")  # virtfn9, virtfn10


def test_captured_tree_with_links_copied_as_directories(tmp_path: Path) -> None:
    """Capture tools copy ``physfn`` and ``virtfnN`` as directories of the device they name."""
    host = sriov_gpu_host(tmp_path, vfs=2)
    for link in (host.device_dir(SRIOV_PF) / "virtfn0", host.device_dir("0000:41:00.4") / "physfn"):
        target = link.resolve()
        link.unlink()
        shutil.copytree(target, link, symlinks=True, copy_function=copy_attr)
    model = gpuwatch.scan(tmp_path)
    assert model.function(SRIOV_PF).sriov.vfs == ("0000:41:00.4", "0000:41:00.5")  # type: ignore[union-attr]
    assert model.function("0000:41:00.4").physfn == SRIOV_PF


def test_vgpu_vf_fields_and_garbage(tmp_path: Path) -> None:
    host = sriov_gpu_host(tmp_path, vfs=2, vgpu=True)
    host.set_vgpu("0000:41:00.4", 1156, VGPU_TYPES[:2])
    host.set_attr("0000:41:00.5", "nvidia/current_vgpu_type", b"\xff\xfejunk\n")
    host.set_attr("0000:41:00.5", "nvidia/creatable_vgpu_types", "ID : vGPU Name\nnone\n")
    model = gpuwatch.scan(tmp_path)
    assert fn_json(model, "0000:41:00.4")["vgpu"] == {"type": 1156, "creatable": [1155, 1156]}
    assert fn_json(model, "0000:41:00.5")["vgpu"] == {"type": 0, "creatable": []}
    assert fn_json(model, SRIOV_PF)["vgpu"] is None  # the PF has no nvidia/ directory


def test_vgpu_needs_the_nvidia_driver(tmp_path: Path) -> None:
    host = sriov_gpu_host(tmp_path, vfs=1, vgpu=True)
    host.unbind("0000:41:00.4")
    assert gpuwatch.scan(tmp_path).function("0000:41:00.4").vgpu is None


# --------------------------------------------------------------------------- uevents


async def test_vfio_dev_add_and_remove_uevents(tmp_path: Path) -> None:
    host = grace_hopper_host(tmp_path, bound=False)
    async with harness_for(host) as h:
        host.unbind(GH_ADDR)
        host.bind(GH_ADDR, "nvgrace_gpu_vfio_pci")
        devpath = host.add_vfio_dev(GH_ADDR, 3)
        start = len(h.events)
        h.source.push(host.uevent_props("unbind", GH_ADDR))
        h.source.push(host.uevent_props("bind", GH_ADDR))
        h.source.push(host.uevent_props("add", devpath))
        got = strip(await h.collect(start, 5))
        assert got[0] == {"type": "driver-changed", "addr": GH_ADDR, "old": "nvidia",
                          "new": "nvgrace_gpu_vfio_pci"}
        # The bind's read already sees vfio-dev (the tree is ahead of the events); the cdev
        # is reported once its node is known.
        assert got[1]["type"] == "device-changed" and got[1]["changed"] == ["vfio_dev"]
        assert got[2] == {"type": "node-added", "path": "/dev/vfio/devices/vfio3"}
        assert got[3]["type"] == "device-changed" and got[3]["changed"] == ["vfio_cdev"]
        assert got[3]["device"]["vfio_cdev"] == "/dev/vfio/devices/vfio3"
        assert got[4]["type"] == "probe-changed" and got[4]["action"] == "detect-vfio"
        assert h.watcher.probe("vfio-backend", addr=GH_ADDR).cdev_node == \
            "/dev/vfio/devices/vfio3"
        # Unbinding from the variant removes vfio-dev first, then the driver link.
        host.remove_vfio_dev(GH_ADDR)
        start = len(h.events)
        h.source.push(host.uevent_props("remove", devpath))
        got = strip(await h.collect(start, 3))
        assert got[0]["type"] == "device-changed" and got[0]["changed"] == ["vfio_dev",
                                                                             "vfio_cdev"]
        assert got[0]["device"]["vfio_dev"] == ""
        assert got[1] == {"type": "node-removed", "path": "/dev/vfio/devices/vfio3"}
        backend = h.watcher.probe("vfio-backend", addr=GH_ADDR)
        assert (backend.cdev_node, backend.on_vfio) == ("", True)  # still on the variant


async def test_iommufd_appears_with_its_module(tmp_path: Path) -> None:
    host = grace_hopper_host(tmp_path, iommufd=False)
    async with harness_for(host) as h:
        devpath = host.add_module("iommufd")
        host.add_dev_node("/dev/iommu")
        got = await h.send("add", devpath, expect=2)
        assert strip(got)[0] == {"type": "node-added", "path": "/dev/iommu"}
        assert got[1]["action"] == "detect-vfio" and got[1]["new"]["iommufd"] is True
        assert h.watcher.probe("vfio-backend", addr=GH_ADDR).recommended == "iommufd"


async def test_vfs_come_and_go(tmp_path: Path) -> None:
    host = sriov_gpu_host(tmp_path)
    async with harness_for(host) as h:
        vfs = add_vfs(host, 2)
        start = len(h.events)
        for vf in vfs:
            h.source.push(host.uevent_props("add", vf))
        got = strip(await h.collect(start, 4))
        # The first VF's event re-reads the PF, whose links already name both VFs.
        assert [e["type"] for e in got] == ["device-added", "device-changed", "device-added",
                                            "probe-changed"]
        assert got[1]["addr"] == SRIOV_PF and got[1]["device"]["sriov"]["vfs"] == vfs
        added = [e for e in got if e["type"] == "device-added"]
        assert [e["device"]["physfn"] for e in added] == [SRIOV_PF, SRIOV_PF]
        pf = h.watcher.model.function(SRIOV_PF)
        assert pf.sriov is not None and (pf.sriov.numvfs, pf.sriov.vfs) == (2, tuple(vfs))
        # echo 0 > sriov_numvfs: each VF goes, and the PF's entry with it (no PF event).
        gone = host.remove_vfs(SRIOV_PF)
        start = len(h.events)
        for vf in gone:
            h.source.push(host.uevent_props("remove", vf))
        got = strip(await h.collect(start, 5))
        removed = [e["addr"] for e in got if e["type"] == "device-removed"]
        assert removed == gone
        pf_changes = [e for e in got if e["type"] == "device-changed"]
        assert [e["device"]["sriov"]["numvfs"] for e in pf_changes] == [1, 0]
        assert all(e["changed"] == ["sriov"] for e in pf_changes)
        assert [g.addr for g in h.watcher.probe("detect-vfio").gpus] == [SRIOV_PF]


async def test_vgpu_type_change_without_a_uevent_is_polled(tmp_path: Path) -> None:
    host = sriov_gpu_host(tmp_path, vfs=2, vgpu=True)
    async with harness_for(host) as h:
        assert await h.watcher.poll_vgpus() == 0  # nothing changed: nothing published
        host.set_vgpu("0000:41:00.5", 1158, VGPU_TYPES[3:])
        start = len(h.events)
        assert await h.watcher.poll_vgpus() == 2
        got = strip(await h.collect(start, 2))
        assert got[0] == {"type": "vgpu-changed", "addr": "0000:41:00.5",
                          "vgpu": {"type": 1158, "creatable": [1158]}}
        assert got[1]["type"] == "probe-changed"
        assert h.watcher.model.function("0000:41:00.5").vgpu.type == 1158  # type: ignore[union-attr]


async def test_aer_recovery_sequence(tmp_path: Path) -> None:
    host = example_gpu_host(tmp_path)
    async with harness_for(host) as h:
        got = await h.send("change", NV, expect=2, ERROR_EVENT="BEGIN_RECOVERY",
                           DEVICE_ONLINE="0")
        assert strip(got)[0] == {"type": "device-error", "addr": NV,
                                 "error_event": "BEGIN_RECOVERY", "online": False,
                                 "health": "recovering"}
        assert h.watcher.model.function(NV).health == "recovering"
        got = await h.send("change", NV, expect=2, ERROR_EVENT="FAILED_RECOVERY")
        assert strip(got)[0]["online"] is None and got[0]["health"] == "failed"
        # A plain change does not clear a failure; nor does an unknown ERROR_EVENT.
        await h.send("change", NV, expect=0)
        await h.send("change", NV, expect=0, ERROR_EVENT="SOMETHING_NEW")
        assert h.watcher.model.function(NV).health == "failed"
        got = await h.send("change", NV, expect=2, ERROR_EVENT="SUCCESSFUL_RECOVERY",
                           DEVICE_ONLINE="1")
        assert (got[0]["online"], got[0]["health"]) == (True, "ok")
        gpu = next(g for g in h.watcher.probe("detect-vfio").gpus if g.addr == NV)
        assert gpu.health == "ok"


async def test_failed_clears_on_rebind_in_one_batch(tmp_path: Path) -> None:
    host = example_gpu_host(tmp_path)
    async with harness_for(host) as h:
        await h.send("change", NV, expect=2, ERROR_EVENT="FAILED_RECOVERY")
        host.unbind(NV)
        host.bind(NV, "nvidia")
        start = len(h.events)
        h.source.push(host.uevent_props("unbind", NV))
        h.source.push(host.uevent_props("bind", NV))
        got = strip(await h.collect(start, 2))
        assert got[0] == {"type": "device-changed", "addr": NV, "changed": ["health"],
                          "device": got[0]["device"]}
        assert got[0]["device"]["health"] == "ok"


async def test_a_bind_during_a_recovery_does_not_end_it(tmp_path: Path) -> None:
    """The kernel holds the device lock only through each error-recovery callback: a bind
    can come between its ``BEGIN_RECOVERY`` and its end, and the recovery goes on (the link
    may still be reset). The function stays ``recovering``, still refused, until its own
    ``SUCCESSFUL_RECOVERY`` ends it."""
    host = example_gpu_host(tmp_path)
    async with harness_for(host) as h:
        await h.send("change", NV, expect=2, ERROR_EVENT="BEGIN_RECOVERY", DEVICE_ONLINE="0")
        host.unbind(NV)
        await h.send("unbind", NV, expect=4)  # driver-changed, three probe-changed
        host.bind(NV, "nvidia")
        got = await h.send("bind", NV, expect=4)
        assert got[0]["type"] == "driver-changed" and got[0]["new"] == "nvidia"
        assert "device-changed" not in [e["type"] for e in got]
        assert h.watcher.model.function(NV).health == "recovering"
        state = h.watcher.model.state
        members = state.group_members(NV)
        reason = unhealthy_reason(members, health_facts(state, members), recover=True)
        assert reason is not None and reason.startswith(f"{NV} is recovering")
        got = await h.send("change", NV, expect=2, ERROR_EVENT="SUCCESSFUL_RECOVERY",
                           DEVICE_ONLINE="1")
        assert got[0]["health"] == "ok" and h.watcher.model.function(NV).health == "ok"


async def test_a_bind_ends_a_recovery_whose_end_was_lost(tmp_path: Path) -> None:
    """A recovery begun more than 300 s ago with no end seen is taken as over (the switch
    no longer waits for it): a bind then is a fresh start, as for a failed function."""
    host = example_gpu_host(tmp_path)
    async with harness_for(host) as h:
        await h.send("change", NV, expect=2, ERROR_EVENT="BEGIN_RECOVERY", DEVICE_ONLINE="0")
        state = h.watcher.model.state
        mark = state.recovery_marks[NV]
        assert mark.at is not None
        state.recovery_marks[NV] = dataclasses.replace(mark, at=time.monotonic() - 400)
        host.unbind(NV)
        await h.send("unbind", NV, expect=4)
        host.bind(NV, "nvidia")
        got = await h.send("bind", NV, expect=5)
        assert [e["type"] for e in got[:2]] == ["driver-changed", "device-changed"]
        assert got[1]["changed"] == ["health"] and got[1]["device"]["health"] == "ok"


@pytest.mark.parametrize("action", ["bind", "add"])
async def test_a_synthetic_bind_or_add_clears_no_health(tmp_path: Path, action: str) -> None:
    """What `udevadm trigger --action=add` (or `echo bind > …/uevent`) sends: the kernel
    marks it with SYNTH_UUID, nothing was bound or added, and a failed or wedged card stays
    so; a real bind after it still clears it."""
    host = example_gpu_host(tmp_path)
    async with harness_for(host) as h:
        await h.send("change", NV, expect=2, ERROR_EVENT="FAILED_RECOVERY")
        await h.send(action, NV, expect=0, SYNTH_UUID="0")
        await h.send(action, NV, expect=0, SYNTH_UUID="6f1d3b2e-8c1a-4c6e-9f3d-1a2b3c4d5e6f",
                     SYNTH_ARG_ERROR_EVENT="SUCCESSFUL_RECOVERY")
        assert h.watcher.model.function(NV).health == "failed"
        got = strip(await h.send("bind", NV, expect=2))
        assert got[0]["type"] == "device-changed" and got[0]["device"]["health"] == "ok"


async def test_drm_wedge(tmp_path: Path) -> None:
    host = example_gpu_host(tmp_path)
    async with harness_for(host) as h:
        got = await h.send("change", CARD1,
                           expect=2, WEDGED="rebind,bus-reset", PID="4242", TASK="Xorg")
        assert strip(got)[0] == {"type": "gpu-wedged", "addr": NV, "card": "card1",
                                 "recovery": ["rebind", "bus-reset"], "pid": 4242,
                                 "task": "Xorg"}
        assert h.watcher.model.function(NV).health == "wedged"
        # Without PID/TASK they are null; an unknown method is kept as the kernel sent it.
        got = await h.send("change", CARD1, expect=1, WEDGED="unknown")
        assert (got[0]["pid"], got[0]["task"], got[0]["recovery"]) == (None, None, ["unknown"])
        # A bind uevent (unbind+bind) clears it.
        host.unbind(NV)
        host.bind(NV, "nvidia")
        start = len(h.events)
        h.source.push(host.uevent_props("unbind", NV))
        h.source.push(host.uevent_props("bind", NV))
        got = strip(await h.collect(start, 2))
        assert got[0]["type"] == "device-changed" and got[0]["device"]["health"] == "ok"


async def test_a_wedge_the_driver_recovered_leaves_health_alone(tmp_path: Path) -> None:
    """``WEDGED=none`` is what amdgpu sends after a ring or GPU reset that worked: the
    device was wedged and its driver recovered it (telemetry only). It is published, but
    the card stays ``ok``, with no recovery methods kept; on a card already wedged it
    neither clears that wedge nor replaces its methods."""
    host = example_gpu_host(tmp_path)
    async with harness_for(host) as h:
        got = strip(await h.send("change", CARD1, expect=1, WEDGED="none", PID="77",
                                 TASK="gnome-shell"))
        assert got == [{"type": "gpu-wedged", "addr": NV, "card": "card1",
                        "recovery": ["none"], "pid": 77, "task": "gnome-shell"}]
        assert h.watcher.model.function(NV).health == "ok"
        assert NV not in h.watcher.model.state.wedge_recovery
        await h.send("change", CARD1, expect=2, WEDGED="rebind")
        await h.send("change", CARD1, expect=1, WEDGED="none")
        assert h.watcher.model.function(NV).health == "wedged"
        assert h.watcher.model.state.wedge_recovery[NV] == ("rebind",)


async def test_hostile_wedge_uevent_is_bounded(tmp_path: Path) -> None:
    host = example_gpu_host(tmp_path)
    async with harness_for(host) as h:
        methods = ",".join(f"m{i}" + "x" * 500 for i in range(100))
        got = await h.send("change", CARD1, expect=2, WEDGED=methods, PID="-3",
                           TASK="t" * 10000)
        assert len(got[0]["recovery"]) == 8
        assert all(len(m) <= 64 for m in got[0]["recovery"])
        assert got[0]["pid"] is None and len(got[0]["task"]) == 64


async def test_resync_keeps_health(tmp_path: Path) -> None:
    host = example_gpu_host(tmp_path)
    async with harness_for(host) as h:
        await h.send("change", NV, expect=2, ERROR_EVENT="FAILED_RECOVERY")
        assert await h.watcher.resync("reconcile") == 0
        assert h.watcher.model.function(NV).health == "failed"


def test_health_is_ok_in_a_fresh_scan(tmp_path: Path) -> None:
    example_gpu_host(tmp_path)
    assert {f.health for f in gpuwatch.scan(tmp_path).functions()} == {"ok"}


async def test_remove_add_starts_with_ok(tmp_path: Path) -> None:
    host = example_gpu_host(tmp_path)
    async with harness_for(host) as h:
        await h.send("change", CARD1, expect=2, WEDGED="bus-reset")
        h.source.push(host.uevent_props("remove", NV))
        h.source.push(host.uevent_props("add", NV))
        with anyio.fail_after(5):
            while h.watcher.model.function(NV).health != "ok":
                await anyio.sleep(0.01)


def test_sysroot_vfio_dev_twice_is_refused(empty_host: SysRoot) -> None:
    empty_host.add_function("0000:03:00.0", driver="vfio-pci", iommu_group=3)
    empty_host.add_vfio_dev("0000:03:00.0", 1)
    with pytest.raises(ValueError):
        empty_host.add_vfio_dev("0000:03:00.0", 2)


async def test_one_batch_keeps_every_recovery_step(tmp_path: Path) -> None:
    """The watcher reads a device once per batch, but every uevent-only fact counts."""
    host = example_gpu_host(tmp_path)
    async with harness_for(host) as h:
        start = len(h.events)
        for step in ("BEGIN_RECOVERY", "FAILED_RECOVERY"):
            h.source.push(host.uevent_props("change", NV, ERROR_EVENT=step, DEVICE_ONLINE="0"))
        h.source.push(host.uevent_props("change", CARD1, WEDGED="vendor-specific"))
        got = strip(await h.collect(start, 4))
        assert [(e["type"], e.get("health")) for e in got[:3]] == [
            ("device-error", "recovering"), ("device-error", "failed"), ("gpu-wedged", None)]
        assert got[3]["type"] == "probe-changed"
        assert h.watcher.model.function(NV).health == "wedged"


async def test_the_library_polls_vgpu_types_on_its_own(tmp_path: Path) -> None:
    """gpuwatch.open_watcher's poll (no uevent says a vGPU type was chosen)."""
    from gpuwatch.sources.memory import MemorySource

    host = sriov_gpu_host(tmp_path, vfs=1, vgpu=True)
    async with gpuwatch.open_watcher(host.root, MemorySource(), reconcile_interval=0,
                                     cdi_poll_interval=0, vgpu_poll_interval=0.05) as w:
        async with w.subscribe(types={"vgpu-changed"}) as sub:
            host.set_vgpu("0000:41:00.4", 1155, VGPU_TYPES)
            with anyio.fail_after(5):
                event = await sub.receive()
        assert (event.addr, event.vgpu.type) == ("0000:41:00.4", 1155)
