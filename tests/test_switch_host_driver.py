"""An interrupted switch of a group whose display is on a host driver of its own (amdgpu on an
AMD host, i915, nouveau) or that has nothing bound: `group_mode` calls these ``host driver``
and ``unbound``, whole states though no switch goes to them. Interrupted, such a switch puts
each function back on the driver it had, as docs/switch.md says of every group but a mixed
one; it never leaves the display on vfio-pci beside its audio on snd_hda_intel.

Every switch runs against a fixture root with the simulated kernel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from gpuwatch.core.modes import group_mode
from gpuwatch.testing import SysRoot
from gpuwatch.testing.machines import amd_apu_dgpu_host
from gpuwatch.testing.simkernel import simulated_switch
from tests.test_switch_engine import AUDIO, NV, of_type
from tests.test_switch_overrides import StopsAfter

DGPU, DGPU_AUDIO = "0000:03:00.0", "0000:03:00.1"  # the RX 7900 XTX and its HDMI audio
PROBE = "/sys/bus/pci/drivers_probe"


async def interrupted(sim: StopsAfter, host: SysRoot, addr: str, *,
                      opened: str = "") -> tuple[list[Any], str]:
    """Switch ``addr``'s group to vfio, cancel it where ``sim`` holds it (a process opening
    ``opened`` first, when given); the events and the group's mode as the model then has it."""
    async with simulated_switch(host, sim=sim) as (w, _s, _e, events):
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: w.switch(addr, "vfio", timeout=60, force=True))
                while not sim.reached:
                    await anyio.sleep(0.005)
                if opened:
                    sim.add_holder(4000, "qemu-system-x86", opened)
                tg.cancel_scope.cancel()
        assert not w.engine.busy
        return list(events), group_mode(w.model.state.group_members(addr))


@pytest.mark.timeout(60)
async def test_an_interrupted_switch_of_an_amd_card_puts_amdgpu_back(tmp_path: Path) -> None:
    """Interrupted once the display is on vfio-pci and its audio still on snd_hda_intel: the
    group was in mode ``host driver``, so the display goes back to amdgpu, and nothing is
    left pinned (amdgpu binds the card by its own id table)."""
    host = amd_apu_dgpu_host(tmp_path / "h")
    sim = StopsAfter(host, PROBE, DGPU)
    events, mode = await interrupted(sim, host, DGPU)
    failed = of_type(events, "switch-failed")
    assert len(failed) == 1 and failed[0].error == "interrupted" and not failed[0].wedged
    assert [sim._driver(DGPU), sim._driver(DGPU_AUDIO)] == ["amdgpu", "snd_hda_intel"], (
        failed[0].restored)
    assert mode == "host driver"
    assert sim.overrides == {}
    assert f"write 'amdgpu' to /sys/bus/pci/devices/{DGPU}/driver_override" in failed[0].restored
    assert not any("in no one mode" in line for line in failed[0].restored)


@pytest.mark.timeout(60)
async def test_an_interrupted_switch_of_an_unbound_group_leaves_it_unbound(
        host: SysRoot) -> None:
    """A group with no driver at all (nothing claimed it at boot) is ``unbound``, not mixed:
    interrupted after the display was bound to vfio-pci, the group is unbound again."""
    host.unbind(NV)
    host.unbind(AUDIO)
    sim = StopsAfter(host, PROBE, NV)
    events, mode = await interrupted(sim, host, NV)
    failed = of_type(events, "switch-failed")
    assert len(failed) == 1 and failed[0].error == "interrupted"
    assert [sim._driver(NV), sim._driver(AUDIO)] == ["", ""], failed[0].restored
    assert mode == "unbound" and sim.overrides == {}


@pytest.mark.timeout(60)
async def test_a_vm_that_opened_the_group_keeps_it_and_the_roll_back_says_so(
        tmp_path: Path) -> None:
    """A VM opened /dev/vfio/5 between the bind and the signal: unbinding vfio-pci now would
    block in the kernel, so the display is left on vfio-pci and `restored` names the holder;
    no unbind of vfio-pci is written."""
    host = amd_apu_dgpu_host(tmp_path / "h")
    sim = StopsAfter(host, PROBE, DGPU)
    events, _mode = await interrupted(sim, host, DGPU, opened="/dev/vfio/5")
    failed = of_type(events, "switch-failed")
    assert len(failed) == 1 and not failed[0].wedged
    assert any("not put back" in line and "qemu-system-x86" in line
               for line in failed[0].restored), failed[0].restored
    assert sim._driver(DGPU) == "vfio-pci" and sim.stuck == []
    assert ("write", "/sys/bus/pci/drivers/vfio-pci/unbind", DGPU) not in sim.record
