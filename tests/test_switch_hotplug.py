"""The PCI topology changing under a switch: the card removed and added again mid-switch
(maybe with another IOMMU group number), and a wedge recorded under the number the group had
before. The switch holds the lock of the group it planned; what it must never do is write on
into a group it does not hold, wait out ``--timeout`` for a device that never got its
writes, or leave a poison no `recover` can lift.

Every switch runs against a fixture root with the simulated kernel.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import anyio
import pytest
from daemon_helpers import env, gpuwatch_cmd

from gpuwatch.errors import SwitchFailed
from gpuwatch.switch.poison import PoisonEntry, PoisonStore
from gpuwatch.testing import SysRoot
from gpuwatch.testing.simkernel import (
    SIMKERNEL_ENV,
    SimKernel,
    save_for_subprocess,
    simulated_switch,
)
from tests.test_switch_engine import AUDIO, NV, drivers, of_type, to_vfio

PORT = "0000:00:01.0"
PROBE = "/sys/bus/pci/drivers_probe"
OVR = "/sys/bus/pci/devices/{}/driver_override"


def readd(sim: SimKernel, group: int, nv_driver: str | None, audio_driver: str | None) -> None:
    """Remove the card (both functions, as a surprise removal does) and add it again in IOMMU
    group ``group`` on the drivers its own probe gives it: the new devices carry no
    ``driver_override``."""
    for addr in (AUDIO, NV):
        devpath = sim.sys.devpath(addr)
        sim.sys.remove_function(addr)
        sim._overrides.pop(addr, None)
        sim.source.push(sim.sys.uevent_props("remove", devpath))
    for addr, device, klass, driver in ((NV, "0x2204", "0x030000", nv_driver),
                                        (AUDIO, "0x1aef", "0x040300", audio_driver)):
        devpath = sim.sys.add_function(addr, parent=PORT, device=device, klass=klass,
                                       driver=driver, iommu_group=group)
        sim.source.push(sim.sys.uevent_props("add", devpath))
        if driver:
            sim.source.push(sim.sys.uevent_props("bind", addr))


class Renumbered(SimKernel):
    """Right after the write ``after``, the card is removed and added again in group 16."""

    def __init__(self, host: SysRoot, after: tuple[str, str], nv_driver: str | None,
                 audio_driver: str | None) -> None:
        super().__init__(host)
        self.after, self.drivers = after, (nv_driver, audio_driver)
        self.readded_at = -1  # the index in `record` of the write the re-add followed

    async def write(self, path: str, value: str, timeout: float) -> None:
        await super().write(path, value, timeout)
        if self.readded_at < 0 and (path, value) == self.after:
            self.readded_at = len(self.record) - 1
            readd(self, 16, *self.drivers)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["vfio", "nvidia"])
async def test_a_card_renumbered_mid_switch_stops_it_and_a_switch_by_address_works(
        host: SysRoot, mode: str) -> None:
    """The card comes back in group 16 while the switch holds group 13's lock. Not one more
    write goes to it (another switch may take group 16, by its own lock, meanwhile; the
    override the switch clears would be that switch's): the switch fails at once naming the
    new group, never completes, leaves nothing poisoned nor recorded as under way; then
    `recover` and a second switch, by address, act on group 16."""
    if mode == "nvidia":
        to_vfio(host)
        sim = Renumbered(host, (PROBE, NV), "nvidia", None)
    else:
        sim = Renumbered(host, (PROBE, NV), None, "snd_hda_intel")
    async with simulated_switch(host, sim=sim) as (w, _s, _e, events):
        with anyio.fail_after(30), pytest.raises(
                SwitchFailed, match=r"is in IOMMU group 16 now, not IOMMU group 13") as info:
            await w.switch(NV, mode, timeout=600)
        after = [r for r in sim.record[sim.readded_at + 1:] if r[0] == "write"]
        assert after == [], after  # nothing written to the card that came back
        assert "(was" in str(info.value) and "in IOMMU group 16" in str(info.value)
        assert of_type(events, "switch-completed") == []
        failed = of_type(events, "switch-failed")
        assert len(failed) == 1 and failed[0].group == 13 and failed[0].wedged is False
        assert w.model.poisoned == {}
        assert not list((host.root / "run/gpuwatch").glob("switch-*.json"))
        recovered = await w.recover(NV, timeout=5)
        assert recovered.group == 16 and drivers(w, NV, AUDIO) == ["vfio-pci"] * 2
        second = await w.switch(NV, "nvidia", timeout=5)
        assert second.group == 16 and drivers(w, NV, AUDIO) == ["nvidia", "snd_hda_intel"]
    assert sim.overrides == {NV: "nvidia", AUDIO: "snd_hda_intel"}  # the second switch's


class LeavesAndComesBack(SimKernel):
    """The display leaves the bus right after its last step, and comes back (a new device,
    unbound: nothing of the switch's on it, and vfio-pci binds nothing by itself) after the
    audio function's probe: same address, same group."""

    left = False

    async def write(self, path: str, value: str, timeout: float) -> None:
        await super().write(path, value, timeout)
        if (path, value) == (OVR.format(NV), "\n") and not self.left:
            self.left = True
            devpath = self.sys.devpath(NV)
            self.sys.remove_function(NV)
            self.source.push(self.sys.uevent_props("remove", devpath))
        elif (path, value) == (PROBE, AUDIO) and NV not in self.sys.functions:
            devpath = self.sys.add_function(NV, parent=PORT, device="0x2204", iommu_group=13)
            self.source.push(self.sys.uevent_props("add", devpath))


@pytest.mark.timeout(60)
async def test_a_function_that_comes_back_unbound_fails_before_the_timeout(
        host: SysRoot) -> None:
    """Its removal was seen, and the device there now never got the switch's writes: nothing
    will bind it to vfio-pci, so the switch fails once its probe had time (the tree check),
    naming it, instead of waiting out --timeout (600 s here)."""
    sim = LeavesAndComesBack(host)
    sim.step_delay = 0.05  # the removal and the add reach the watcher apart, as on a host
    async with simulated_switch(host, sim=sim, tree_check_after=0.5) as (w, _s, _e, events):
        with anyio.fail_after(30), pytest.raises(
                SwitchFailed, match=rf"{NV} left the bus and came back during the switch"):
            await w.switch(NV, "vfio", timeout=600)
        assert of_type(events, "switch-completed") == []
        assert w.model.poisoned == {}
        await w.recover(NV, timeout=5)
        assert drivers(w, NV, AUDIO) == ["vfio-pci"] * 2


def poison_then_renumber(host: SysRoot) -> PoisonStore:
    """Group 13 poisoned by a wedge of the card's switch; since then the card was removed
    and added again (the stuck task returned), in group 16, on vfio-pci."""
    store = PoisonStore(str(host.root))
    store.add(13, PoisonEntry(addr=NV, to_mode="nvidia", time="2026-01-01T00:00:00Z",
                              error="write to /sys/bus/pci/drivers/vfio-pci/unbind did not "
                                    "return within 30s: the device is wedged"))
    to_vfio(host)
    host.set_iommu_group(NV, 16)
    host.set_iommu_group(AUDIO, 16)
    return store


async def test_recover_lifts_a_poison_recorded_under_the_old_group_number(
        host: SysRoot) -> None:
    """Keyed by a number no longer the card's, the poison of group 13 would stay until the
    next boot (no `recover` of group 16 looked at it) and refuse whatever group gets 13 next.
    `recover` of the card lifts it, and says so."""
    store = poison_then_renumber(host)
    async with simulated_switch(host) as (w, _s, _e, _ev):
        assert 13 in w.model.poisoned
        result = await w.recover(NV, timeout=5)
        assert any("poison of IOMMU group 13 cleared" in n for n in result.notes), result.notes
        assert w.model.poisoned == {}
        done = await w.switch(NV, "nvidia", timeout=5)
        assert done.changed and done.group == 16
    assert store.load() == {}


@pytest.mark.timeout(120)
def test_recover_cli_lifts_the_old_number_and_mode_works(host: SysRoot, tmp_path: Path) -> None:
    """The same through `gpuwatch recover` and `gpuwatch mode --no-daemon` processes: exit 0,
    the file holds no poison, and the next watcher refuses nothing."""
    store = poison_then_renumber(host)
    saved = tmp_path / "simkernel.pickle"
    save_for_subprocess(SimKernel(host), saved)

    def gw(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            gpuwatch_cmd(*argv, "--addr", NV, "--root", str(host.root), "--timeout", "30"),
            capture_output=True, text=True, timeout=90, env={**env(), SIMKERNEL_ENV: str(saved)})

    recovered = gw("recover")
    assert recovered.returncode == 0, recovered.stderr
    assert store.load() == {}
    switched = gw("mode", "nvidia", "--no-daemon")
    assert switched.returncode == 0, switched.stderr
    assert "Traceback" not in switched.stderr + recovered.stderr


class VanishesUnseen(SimKernel):
    """The audio function leaves the bus right after its last step, and the watcher has not
    read the removal's uevent yet (here: it never comes) when the binds are all seen."""

    async def write(self, path: str, value: str, timeout: float) -> None:
        await super().write(path, value, timeout)
        if (path, value) == (OVR.format(AUDIO), "\n"):
            self.sys.remove_function(AUDIO)


@pytest.mark.timeout(60)
async def test_no_completion_while_the_tree_shows_a_planned_function_gone(
        host: SysRoot) -> None:
    """The model shows every function on vfio-pci, the tree shows the audio function gone:
    `switch-completed` would name a function that is not there. The switch fails, naming it,
    and a recover then completes on what is left."""
    sim = VanishesUnseen(host)
    async with simulated_switch(host, sim=sim) as (w, _s, _e, events):
        with anyio.fail_after(30), pytest.raises(SwitchFailed, match=rf"{AUDIO} left the bus"):
            await w.switch(NV, "vfio", timeout=600)
        assert of_type(events, "switch-completed") == []
        result = await w.recover(NV, timeout=5)
        assert [m.addr for m in result.members] == [NV]
