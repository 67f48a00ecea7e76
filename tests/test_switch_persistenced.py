"""nvidia-persistenced across a round trip: the switch to vfio stops it to unload nvidia, and
the switch back starts it again, but only when a switch stopped it (one the operator stopped
stays stopped), only in the same boot, and `gpuwatch plan` shows that step.

Every switch runs against a fixture root with the simulated kernel.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import anyio
import pytest

from gpuwatch.errors import SwitchFailed
from gpuwatch.hostfs.bootstate import DEFAULT_STOPPED_FILE, stopped_services
from gpuwatch.switch.hostops import CommandResult
from gpuwatch.testing import SysRoot
from gpuwatch.testing.simkernel import SimKernel, simulated_switch
from tests.test_switch_engine import NV, add_second_card, drivers, of_type

START = ("systemctl", "start", "nvidia-persistenced")
STOP = ("systemctl", "stop", "nvidia-persistenced")


def persistenced_pids(host: SysRoot) -> list[int]:
    return [int(p.name) for p in (host.root / "proc").iterdir() if p.name.isdigit()
            and (p / "comm").read_text().startswith("nvidia-persist")]


async def test_the_switch_back_starts_what_the_switch_to_vfio_stopped(host: SysRoot) -> None:
    sim = SimKernel(host)
    sim.start_persistenced(777)
    async with simulated_switch(host, sim=sim) as (w, _s, _e, _ev):
        await w.switch(NV, "vfio", timeout=5)
        assert persistenced_pids(host) == []
        assert stopped_services(str(host.root)) == {"nvidia-persistenced"}
        plan = await w.plan(NV, "nvidia")
        argvs = [tuple(s["argv"]) for s in plan["steps"] if s["kind"] == "command"]
        # After nvidia-modprobe: persistenced opens /dev/nvidiactl, which that makes.
        assert argvs.index(START) == argvs.index(("nvidia-modprobe", "-c", "0", "-u")) + 1
        await w.switch(NV, "nvidia", timeout=5)
        assert drivers(w, NV) == ["nvidia"]
    assert sim.commands.count(START) == 1 and len(persistenced_pids(host)) == 1
    assert stopped_services(str(host.root)) == frozenset()  # done: forgotten


async def test_persistenced_the_operator_stopped_stays_stopped(host: SysRoot) -> None:
    sim = SimKernel(host)  # persistenced not running when the card left nvidia
    async with simulated_switch(host, sim=sim) as (w, _s, _e, _ev):
        await w.switch(NV, "vfio", timeout=5)
        await w.switch(NV, "nvidia", timeout=5)
    assert START not in sim.commands and STOP not in sim.commands
    assert persistenced_pids(host) == []


async def test_a_record_of_another_boot_starts_nothing(host: SysRoot) -> None:
    sim = SimKernel(host)
    sim.start_persistenced(777)
    async with simulated_switch(host, sim=sim) as (w, _s, _e, _ev):
        await w.switch(NV, "vfio", timeout=5)
    sim.reboot("0b8e7d6c-5a4f-4e3d-9c2b-1a0f9e8d7c6b")  # the unit, not gpuwatch, decides now
    async with simulated_switch(host, sim=sim) as (w, _s, _e, _ev):
        await w.switch(NV, "nvidia", timeout=5)
    assert START not in sim.commands
    saved = json.loads((host.root / DEFAULT_STOPPED_FILE).read_text())
    assert saved["services"] == ["nvidia-persistenced"]  # the old boot's, ignored


async def test_running_persistenced_is_not_started_twice(host: SysRoot) -> None:
    """Two cards: the first leaves nvidia with the module (persistenced stopped and started
    around its unbind); the record is clean, and the way back starts nothing."""
    add_second_card(host)
    sim = SimKernel(host)
    sim.start_persistenced(777)
    async with simulated_switch(host, sim=sim) as (w, _s, _e, _ev):
        await w.switch(NV, "vfio", timeout=5)
        assert sim.commands[0] == STOP and START in sim.commands
        assert stopped_services(str(host.root)) == frozenset()
        before = sim.commands.count(START)
        await w.switch(NV, "nvidia", timeout=5)
    assert sim.commands.count(START) == before and len(persistenced_pids(host)) == 1


async def test_a_failed_switch_that_restarted_persistenced_forgets_it(host: SysRoot) -> None:
    """The switch to vfio stops persistenced, then fails (vfio_pci cannot load): restoring
    starts it again, so nothing is left for a later switch back to start."""
    sim = SimKernel(host)
    sim.start_persistenced(777)
    sim.fail_modules.add("vfio_pci")
    host.remove_module("vfio_pci")
    async with simulated_switch(host, sim=sim) as (w, _s, _e, _ev):
        with pytest.raises(SwitchFailed, match="not found"):
            await w.switch(NV, "vfio", timeout=5)
    assert START in sim.commands and len(persistenced_pids(host)) == 1
    assert stopped_services(str(host.root)) == frozenset()


class SlowVfioLoad(SimKernel):
    """``modprobe vfio_pci`` takes long: a cancel lands after nvidia was unloaded."""

    reached = False

    async def run(self, argv: Sequence[str], timeout: float) -> CommandResult:
        if list(argv) == ["modprobe", "vfio_pci"]:
            self.reached = True
            await anyio.sleep(10)
        return await super().run(argv, timeout)


async def test_an_interrupted_switch_starts_persistenced_once(host: SysRoot) -> None:
    """Interrupted after persistenced was stopped and nvidia unloaded: the roll-back's switch
    back starts persistenced (the record says a switch stopped it), and the restoring that
    follows does not start it a second time."""
    host.remove_module("vfio_pci")
    sim = SlowVfioLoad(host)
    sim.start_persistenced(777)
    async with simulated_switch(host, sim=sim) as (w, _s, _e, events):
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(w.switch, NV, "vfio")
                while not sim.reached:
                    await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
        assert drivers(w, NV) == ["nvidia"]
    restored = of_type(events, "switch-failed")[0].restored
    assert sum("systemctl start nvidia-persistenced" in r for r in restored) == 1
    assert sim.commands.count(START) == 1 and len(persistenced_pids(host)) == 1
    assert stopped_services(str(host.root)) == frozenset()


async def test_a_record_spent_by_a_manual_start_does_not_restart_a_later_stop(
        host: SysRoot) -> None:
    """The operator started persistenced while the card was on vfio: the switch back finds it
    running and the record is spent. The operator then stops it on purpose; a later round
    trip (which stops nothing) must not start it."""
    sim = SimKernel(host)
    sim.start_persistenced(777)
    async with simulated_switch(host, sim=sim) as (w, _s, _e, _ev):
        await w.switch(NV, "vfio", timeout=5)
        sim.start_persistenced(778)  # by hand, card away
        await w.switch(NV, "nvidia", timeout=5)
        assert START not in sim.commands
        assert stopped_services(str(host.root)) == frozenset()
        host.remove_process(778)  # stopped on purpose
        await w.switch(NV, "vfio", timeout=5)
        await w.switch(NV, "nvidia", timeout=5)
    assert START not in sim.commands and persistenced_pids(host) == []
