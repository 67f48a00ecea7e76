"""The switch against a kernel that misbehaves mid-switch: a group that gains a member, a VM
that opens the device cdev between the plan and the unbind. The host is never left wedged,
and a failure names what it left.

Every switch runs against a fixture root with the simulated kernel.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import anyio
import pytest

from gpuwatch.errors import HostStepError, SwitchFailed, SwitchRefused, SwitchWedged
from gpuwatch.testing import SysRoot
from gpuwatch.testing.modern import GH_ADDR, grace_hopper_host
from gpuwatch.testing.simkernel import SimKernel, simulated_switch
from tests.test_switch_engine import AUDIO, NV, drivers, of_type, to_vfio

USB = "0000:01:00.2"  # the card's USB-C controller, made visible mid-switch


class GainsAMember(SimKernel):
    """After the first ``drivers_probe``, a new function joins the group on xhci_hcd (a
    hot-add, or a function the firmware hid until now)."""

    async def write(self, path: str, value: str, timeout: float) -> None:
        await super().write(path, value, timeout)
        if path == "/sys/bus/pci/drivers_probe" and USB not in self.sys.functions:
            devpath = self.sys.add_function(USB, parent="0000:00:01.0", device="0x1ad6",
                                            klass="0x0c0330", driver="xhci_hcd",
                                            iommu_group=13)
            self.source.push(self.sys.uevent_props("add", devpath))


async def test_a_group_that_gains_a_member_mid_switch_is_no_completion(host: SysRoot) -> None:
    """The planned functions reach vfio-pci, but the group now holds a function on a host
    driver: a VM cannot open it. Not `switch-completed`: a failure naming the newcomer, and
    the next switch takes it along (with its holder checks)."""
    host.add_module("xhci_hcd")
    sim = GainsAMember(host)
    async with simulated_switch(host, sim=sim) as (w, _s, _e, events):
        with pytest.raises(SwitchFailed, match=rf"gained {USB} \(on xhci_hcd\)") as info:
            await w.switch(NV, "vfio", timeout=5)
        assert of_type(events, "switch-completed") == []
        failed = of_type(events, "switch-failed")
        assert len(failed) == 1 and USB in failed[0].error and failed[0].wedged is False
        assert "is not as it was" in str(info.value)  # what the switch left changed
        assert w.probe("group-in-mode", addr=NV, mode="vfio") is False
        done = await w.switch(NV, "vfio", timeout=5)
        assert done.changed and drivers(w, NV, AUDIO, USB) == ["vfio-pci"] * 3
    assert ("write", "/sys/bus/pci/drivers/xhci_hcd/unbind", USB) in sim.record


async def test_a_member_that_joins_already_on_vfio_completes(host: SysRoot) -> None:
    """A function that joins the group already on vfio-pci leaves the group in mode."""

    class GainsOnVfio(SimKernel):
        async def write(self, path: str, value: str, timeout: float) -> None:
            await super().write(path, value, timeout)
            if path == "/sys/bus/pci/drivers_probe" and USB not in self.sys.functions:
                devpath = self.sys.add_function(USB, parent="0000:00:01.0", device="0x1ad6",
                                                klass="0x0c0330", driver="vfio-pci",
                                                iommu_group=13)
                self.source.push(self.sys.uevent_props("add", devpath))

    sim = GainsOnVfio(host)
    async with simulated_switch(host, sim=sim) as (w, _s, _e, _ev):
        done = await w.switch(NV, "vfio", timeout=5)
        assert done.changed and w.probe("group-in-mode", addr=NV, mode="vfio") is True


async def test_a_vm_opening_the_cdev_before_the_unbind_refuses_and_wedges_nothing(
        tmp_path: Path) -> None:
    """Grace-Hopper on nvgrace_gpu_vfio_pci, going to nvidia: the plan saw no holder, then a
    VM opened /dev/vfio/devices/vfio0 (iommufd, no group node). The variant's remove would
    wait for it forever: the re-scan right before the unbind refuses, nothing is unbound."""
    host = grace_hopper_host(tmp_path / "h")
    (host.root / "dev/vfio/19").unlink()  # an iommufd-only VMM: the cdev is its only handle
    sim = SimKernel(host)

    def vm_starts(event: Any) -> None:
        if getattr(event, "type", None) == "switch-started":
            sim.add_holder(4000, "qemu-system-aar", "/dev/vfio/devices/vfio0")

    async with simulated_switch(host, sim=sim) as (w, _s, _e, _ev):
        w.listeners.append(vm_starts)
        with pytest.raises(SwitchRefused, match="/dev/vfio/devices/vfio0"):
            await w.switch(GH_ADDR, "nvidia", timeout=5)
        assert drivers(w, GH_ADDR) == ["nvgrace_gpu_vfio_pci"]
        assert w.probe("wedge-detected") is False and sim.stuck == []
    assert not any(r[0] == "write" and r[1].endswith("/unbind") for r in sim.record)


async def test_the_simulated_variant_remove_waits_for_its_cdev(tmp_path: Path) -> None:
    """The hazard the guard exists for, modelled: with the guard bypassed, the variant's
    unbind hangs while the cdev is held (so the test above could catch a missing re-scan)."""
    host = grace_hopper_host(tmp_path / "h")
    sim = SimKernel(host)
    sim.add_holder(4000, "qemu-system-aar", "/dev/vfio/devices/vfio0")
    assert sim._unbind_blocked(GH_ADDR, "nvgrace_gpu_vfio_pci") is True
    sim.sys.remove_process(4000)
    assert sim._unbind_blocked(GH_ADDR, "nvgrace_gpu_vfio_pci") is False


async def test_recover_touches_nothing_while_a_vfio_unbind_is_stuck(host: SysRoot) -> None:
    """vfio-pci's remove waits for the VM holding the device: the switch to nvidia wedges and
    poisons the group. That is not nvidia's wedge (wedge-detected stays false, as its contract
    says), but recover must not call the group recovered (nor bind anything) while the task
    is stuck; once the unbind returns, recover rebinds and clears the poison."""
    to_vfio(host)
    sim = SimKernel(host)
    sim.wedge_unbind.add("vfio-pci")
    async with simulated_switch(host, sim=sim) as (w, _s, _e, _ev):
        with pytest.raises(SwitchWedged):
            await w.switch(NV, "nvidia", timeout=1.0)
        assert w.probe("wedge-detected") is False
        before = list(sim.record)
        with pytest.raises(SwitchRefused, match="stuck in a driver's remove"):
            await w.recover(NV, timeout=5)
        assert sim.record == before and 13 in w.model.poisoned
        sim.wedge_unbind.clear()
        sim.release_stuck()  # the VM let go: the unbind returned
        result = await w.recover(NV, timeout=5)
        assert any("poison of group 13 cleared" in n for n in result.notes)
        assert drivers(w, NV) == ["vfio-pci"]


class ProbeFails(SimKernel):
    """``drivers_probe`` of the audio function fails (EINVAL: the driver's probe failed)."""

    async def write(self, path: str, value: str, timeout: float) -> None:
        if path == "/sys/bus/pci/drivers_probe" and value == AUDIO:
            self.record.append(("write", path, value))
            raise HostStepError(errno.EINVAL, f"write {value} to {path}: Invalid argument")
        await super().write(path, value, timeout)


async def test_a_failed_probe_leaves_no_function_pinned_to_vfio(host: SysRoot) -> None:
    """The switch to vfio fails between the audio function's driver_override and its
    clearing: left so, nothing but vfio-pci would ever bind it again. The failure clears the
    override and says so, along with what it left unbound."""
    sim = ProbeFails(host)
    override = host.root / f"sys/bus/pci/devices/{AUDIO}/driver_override"
    async with simulated_switch(host, sim=sim) as (w, _s, _e, events):
        with pytest.raises(SwitchFailed, match="Invalid argument") as info:
            await w.switch(NV, "vfio", timeout=5)
    cleared = f"write '\\n' to /sys/bus/pci/devices/{AUDIO}/driver_override"
    assert override.read_text() == "(null)\n"
    assert sim.writes[-1] == (f"/sys/bus/pci/devices/{AUDIO}/driver_override", "\n")
    assert cleared in info.value.restored and cleared in str(info.value)
    assert f"{AUDIO} on no driver (was snd_hda_intel)" in str(info.value)
    assert cleared in of_type(events, "switch-failed")[0].restored
    # The display function's override was cleared by the plan itself: not written twice.
    assert sim.writes.count((f"/sys/bus/pci/devices/{NV}/driver_override", "\n")) == 1


class VanishesAfterItsSteps(SimKernel):
    """The audio function leaves the bus right after its last step (a surprise removal)."""

    async def write(self, path: str, value: str, timeout: float) -> None:
        await super().write(path, value, timeout)
        if path == f"/sys/bus/pci/devices/{AUDIO}/driver_override" and value == "\n":
            devpath = self.sys.devpath(AUDIO)
            self.sys.remove_function(AUDIO)
            self.source.push(self.sys.uevent_props("remove", devpath))


async def test_a_function_that_leaves_the_bus_fails_the_switch_at_once(host: SysRoot) -> None:
    """It will never bind: the switch fails once the tree confirms it is gone, naming it,
    instead of waiting out its --timeout (600 s here; the bound only catches a wait)."""
    sim = VanishesAfterItsSteps(host)
    async with simulated_switch(host, sim=sim) as (w, _s, _e, events):
        with anyio.fail_after(60), pytest.raises(SwitchFailed, match=rf"{AUDIO} left the bus"):
            await w.switch(NV, "vfio", timeout=600)
    failed = of_type(events, "switch-failed")
    assert len(failed) == 1 and f"{AUDIO} gone (was snd_hda_intel)" in failed[0].restored[-1]


class AnotherDriverTakesIt(SimKernel):
    """Right after the switch unbinds ``addr``, ``grabber`` binds it (a racing probe: a udev
    rule's ``drivers_probe``, a module loaded meanwhile), before its ``driver_override`` is
    written; or, with ``grabber`` None, the unbind reports success and takes nothing."""

    def __init__(self, host: SysRoot, addr: str, grabber: str | None) -> None:
        super().__init__(host)
        self.addr, self.grabber = addr, grabber

    def _unbind(self, addr: str) -> None:
        if addr != self.addr:
            super()._unbind(addr)
        elif self.grabber is not None:
            super()._unbind(addr)
            self._bind(addr, self.grabber)
        # else: the unbind "succeeds" and the driver stays


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("mode", "addr", "grabber", "was"), [
    ("vfio", AUDIO, "snd_hda_intel", "snd_hda_intel"),  # snd_hda_intel takes it back
    ("nvidia", NV, "nouveau", "vfio-pci"),  # nouveau beats nvidia to the card
    ("vfio", AUDIO, None, "snd_hda_intel"),  # the unbind did not take
], ids=["racing-snd-hda-intel", "nouveau", "unbind-no-op"])
async def test_a_function_another_driver_holds_fails_at_the_tree_check(
        host: SysRoot, mode: str, addr: str, grabber: str | None, was: str) -> None:
    """Once every write has returned, a function on a driver that is not its target stays
    there (an override only steers the probe of an unbound device): the switch fails at its
    first tree check, naming the function and the driver, not after its --timeout (600 s
    here), never completes, and leaves no override of its own."""
    if mode == "nvidia":
        to_vfio(host)
    sim = AnotherDriverTakesIt(host, addr, grabber)
    holder = grabber or was
    want = "vfio-pci" if mode == "vfio" else "nvidia"
    async with simulated_switch(host, sim=sim, tree_check_after=0.2) as (w, _s, _e, events):
        with anyio.fail_after(30), pytest.raises(
                SwitchFailed, match=rf"{addr} is on {holder}, not {want}, once every write"):
            await w.switch(NV, mode, timeout=600)
        assert w.model.state.functions[addr].driver == holder
    assert of_type(events, "switch-completed") == []
    failed = of_type(events, "switch-failed")
    assert len(failed) == 1 and failed[0].wedged is False
    assert sim.overrides == {}
