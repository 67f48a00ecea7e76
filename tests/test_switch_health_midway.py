"""A function of the group (or the bridge above it) that fails or wedges while its switch is
under way, a healthy function behind a failed bridge, and what the switch's restoring may
write then: never a bind, an unbind or an override to a device that is not healthy."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

import gpuwatch
from gpuwatch.core.observations import PciErrorSeen, PciRebound
from gpuwatch.core.plan import HostFacts, needs_recovery, plan_switch, unhealthy_reason
from gpuwatch.errors import SwitchFailed, SwitchRefused
from gpuwatch.hostfs.facts import health_facts, recovery_facts
from gpuwatch.testing import SysRoot
from gpuwatch.testing.simkernel import SimKernel, simulated_switch

NV, AUDIO = "0000:01:00.0", "0000:01:00.1"
ROOT_PORT = "0000:00:01.0"  # the bridge above the example card
CARD1 = "/devices/pci0000:00/0000:00:01.0/0000:01:00.0/drm/card1"


def _trouble(host: SysRoot, what: str) -> tuple[dict[str, str], str, str]:
    """The uevent of ``what``, the function whose health it changes, and that health."""
    if what == "wedge":
        return host.uevent_props("change", CARD1, WEDGED="bus-reset"), NV, "wedged"
    if what == "bridge":
        return (host.uevent_props("change", ROOT_PORT, ERROR_EVENT="FAILED_RECOVERY",
                                  DEVICE_ONLINE="0"), ROOT_PORT, "failed")
    return (host.uevent_props("change", NV, ERROR_EVENT="FAILED_RECOVERY", DEVICE_ONLINE="0"),
            NV, "failed")


async def _health(w: Any, addr: str, health: str) -> None:
    with anyio.fail_after(5):
        while w.model.function(addr).health != health:
            await anyio.sleep(0.01)


def _touches(record: list[tuple[str, ...]], addr: str) -> list[tuple[str, ...]]:
    """The writes of ``record`` that act on ``addr`` (a bind, an unbind, an override, a
    probe)."""
    return [r for r in record if r[0] == "write" and (r[2] == addr or f"/{addr}/" in r[1])]


def _troubled(w: Any, host: SysRoot, what: str) -> Callable[[], Awaitable[None]]:
    """Sends the uevent of ``what`` (`_trouble`) and waits until the model holds its health."""

    async def send() -> None:
        uevent, addr, health = _trouble(host, what)
        w.source.push(uevent)
        await _health(w, addr, health)

    return send


async def _recover_meanwhile(w: Any, sim: SimKernel, match: str, started: Callable[[], bool],
                             trouble: Callable[[], Awaitable[None]]) -> int:
    """`recover` of the card, which must fail with ``match``; once ``started()`` says it is
    under way, ``trouble()`` runs. Returns how many steps the kernel had seen by then (the
    steps are instant after it, so recover's last writes, if any, come at once)."""
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:

            async def recover() -> None:
                with pytest.raises(SwitchFailed, match=match):
                    await w.recover(NV, timeout=20)

            tg.start_soon(recover)
            while not started():
                await anyio.sleep(0.005)
            await trouble()
            seen = len(sim.record)
            sim.step_delay = 0.0
    return seen


# --------------------------------------------------------------------------- 1: mid-switch


@pytest.mark.parametrize("what", ["failed", "wedge", "bridge"])
async def test_a_failure_during_the_switch_stops_its_writes(host: SysRoot, what: str) -> None:
    """The card fails PCI error recovery (or its driver declares it wedged, or the root port
    above it fails recovery) while the switch to vfio runs its first step: not one more
    write, bind or unbind goes to the group, no module is loaded back onto it, and the
    switch fails naming the function and what happened."""
    async with simulated_switch(host) as (w, sim, _engine, events):
        sim.step_delay = 1.0
        uevent, addr, health = _trouble(host, what)
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:

                async def switch() -> None:
                    with pytest.raises(SwitchFailed) as info:
                        await w.switch(NV, "vfio", timeout=20)
                    assert addr in str(info.value) and health in str(info.value)
                    assert "during the switch" in str(info.value)

                tg.start_soon(switch)
                while not sim.record:
                    await anyio.sleep(0.01)
                w.source.push(uevent)
                await _health(w, addr, health)
                seen = len(sim.record)
                sim.step_delay = 0.0
        after = sim.record[seen:]
        assert not [r for r in after if r[0] == "write"], after
        assert not [r for r in after if r[:2] == ("command", "modprobe") and "-r" not in r], after
        failed = [e for e in events if e.type == "switch-failed"]
        assert len(failed) == 1 and addr in failed[0].error  # type: ignore[attr-defined]
        assert not failed[0].wedged  # type: ignore[attr-defined]


async def test_a_failure_while_waiting_for_the_binds_fails_at_once(host: SysRoot) -> None:
    """Every write returned and the switch waits for the bind events: a failure seen then
    ends it at once with its reason, not after --timeout with "did not reach its target"."""
    async with simulated_switch(host, tree_check_after=60) as (w, sim, _engine, _events):
        sim.lose_bind_events = True
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:

                async def switch() -> None:
                    with pytest.raises(SwitchFailed, match=rf"{NV} is failed: .*during the switch"):
                        await w.switch(NV, "vfio", timeout=90)

                tg.start_soon(switch)
                clear = ("write", f"/sys/bus/pci/devices/{NV}/driver_override", "\n")
                while clear not in sim.record:
                    await anyio.sleep(0.01)
                await anyio.sleep(0.2)
                w.source.push(_trouble(host, "failed")[0])
                started = anyio.current_time()
        assert anyio.current_time() - started < 3


async def test_recover_stops_on_a_new_failure_of_another_function(host: SysRoot) -> None:
    """`recover` rebinds the failed card; the root port above it failing meanwhile is a new
    failure, not the one recover was asked to clear: recover stops there too."""
    async with simulated_switch(host) as (w, sim, _engine, _events):
        assert (await w.switch(NV, "vfio", timeout=10)).changed
        w.source.push(_trouble(host, "failed")[0])
        await _health(w, NV, "failed")
        before = len(sim.record)
        sim.step_delay = 1.0
        seen = await _recover_meanwhile(
            w, sim, rf"{ROOT_PORT}.*failed", lambda: len(sim.record) > before,
            _troubled(w, host, "bridge"))
        assert not [r for r in sim.record[seen:] if r[0] == "write"], sim.record[seen:]


async def test_recover_stops_when_the_card_wedges_again_after_its_bind(host: SysRoot) -> None:
    """`recover` of a wedged card: once its bind is seen (its health ok), a second wedge is
    a new failure, though a wedge uevent carries no rank: the step after it (clearing the
    override) is not written."""
    async with simulated_switch(host) as (w, sim, _engine, _events):
        w.source.push(_trouble(host, "wedge")[0])
        await _health(w, NV, "wedged")
        probe = ("write", "/sys/bus/pci/drivers_probe", NV)
        sim.step_delay = 0.5
        wedge_again = _troubled(w, host, "wedge")

        async def after_its_bind() -> None:
            await _health(w, NV, "ok")  # its bind, seen
            await wedge_again()

        seen = await _recover_meanwhile(w, sim, rf"{NV} is wedged: .*during the ",
                                        lambda: probe in sim.record, after_its_bind)
        assert _touches(sim.record[seen:], NV) == [], sim.record[seen:]


# --------------------------------------------------------------------------- 2: bridge


async def test_a_healthy_card_behind_a_failed_bridge_is_refused(host: SysRoot) -> None:
    """The root port above the card failed its PCI error recovery (the kernel reports it on
    the bridge alone): the card's own health reads ok, but its link is down. Refused in
    either direction, naming the bridge, nothing written; the plan says the same."""
    async with simulated_switch(host) as (w, sim, _engine, events):
        w.source.push(_trouble(host, "bridge")[0])
        await _health(w, ROOT_PORT, "failed")
        assert w.model.function(NV).health == "ok"
        for mode in ("vfio", "nvidia"):
            with pytest.raises(SwitchRefused, match=rf"{NV} is behind bridge {ROOT_PORT}, "
                                                     r"whose PCI error recovery failed"):
                await w.switch(NV, mode, timeout=5)
        plan = await w.plan(NV, "vfio")
        assert plan["refused"] is not None and ROOT_PORT in plan["refused"]["reason"]
        assert sim.record == []
        assert [e.type for e in events if e.type.startswith("switch-")] == \
            ["switch-refused"] * 2


async def test_recover_rebinds_a_card_behind_a_failed_bridge(host: SysRoot) -> None:
    """As for a card itself failed, `recover` rebinds it (its bind, seen after the bridge's
    failure, is its recovery); a switch goes ahead after that."""
    async with simulated_switch(host) as (w, _sim, _engine, _events):
        w.source.push(_trouble(host, "bridge")[0])
        await _health(w, ROOT_PORT, "failed")
        result = await w.recover(NV, timeout=10)
        assert result.changed
        assert (await w.switch(NV, "nvidia", timeout=10)).changed


def test_the_pure_rule_for_a_failed_bridge(host: SysRoot) -> None:
    """The bridge's failure counts for a function below it until a later sign of life of
    that function, or of another behind the same bridge (a bind, a recovery uevent of its
    own: the kernel reaches it, so the link is up)."""
    state = gpuwatch.scan(host.root).state
    members = state.group_members(NV)
    assert unhealthy_reason(members, health_facts(state, members)) is None
    state.apply(PciErrorSeen(ROOT_PORT, "FAILED_RECOVERY", False))
    facts = health_facts(state, members)
    assert recovery_facts(state, [NV, AUDIO]).failed_bridge == {NV: ROOT_PORT, AUDIO: ROOT_PORT}
    reason = unhealthy_reason(members, facts) or ""
    assert reason.startswith(f"{NV} is behind bridge {ROOT_PORT}, whose PCI error "
                             "recovery failed") and "/remove" in reason, reason
    assert unhealthy_reason(members, facts, recover=True) is None
    assert all(needs_recovery(fn, facts) for fn in members)
    plan = plan_switch(members, "vfio", facts)
    assert plan.refusal is not None and ROOT_PORT in plan.refusal.reason and not plan.steps
    # The card bound since: the link below the bridge is up, for its audio function too.
    state.apply(PciRebound(NV))
    assert recovery_facts(state, [NV, AUDIO]).failed_bridge == {}
    state.apply(PciErrorSeen(ROOT_PORT, "FAILED_RECOVERY", False))  # and failed again
    assert recovery_facts(state, [NV, AUDIO]).failed_bridge == {NV: ROOT_PORT, AUDIO: ROOT_PORT}
    state.apply(PciErrorSeen(AUDIO, "BEGIN_RECOVERY", False))  # the kernel reaches it
    assert recovery_facts(state, [NV, AUDIO]).failed_bridge == {}
    state.apply(PciErrorSeen(AUDIO, "SUCCESSFUL_RECOVERY", True))
    assert recovery_facts(state, [NV, AUDIO]).failed_bridge == {}
    assert unhealthy_reason(members, HostFacts()) is None


# --------------------------------------------------------------------------- 3: restoring


async def test_restoring_writes_no_override_to_a_failed_function(host: SysRoot) -> None:
    """The switch has written the card's driver_override when the card fails: the restoring
    does not clear it (the write takes the device lock of a device the kernel gave up on),
    it says the override was left for the card's recovery, and writes nothing else to it."""
    async with simulated_switch(host) as (w, sim, _engine, _events):
        override = ("write", f"/sys/bus/pci/devices/{NV}/driver_override", "vfio-pci")
        sim.step_delay = 0.3
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:

                async def switch() -> None:
                    with pytest.raises(SwitchFailed) as info:
                        await w.switch(NV, "vfio", timeout=20)
                    assert (f"{NV} is failed: its driver_override is left for its recovery, "
                            "not cleared") in info.value.restored, info.value.restored

                tg.start_soon(switch)
                while override not in sim.record:
                    await anyio.sleep(0.005)
                w.source.push(_trouble(host, "failed")[0])
                await _health(w, NV, "failed")
                seen = len(sim.record)
                sim.step_delay = 0.0
        assert _touches(sim.record[seen:], NV) == [], sim.record[seen:]
        assert sim.overrides.get(NV) == "vfio-pci"


class LeavesAfterItsOverride(SimKernel):
    """The audio function leaves the bus right after its override was written, and the
    switch's next write to it fails (the device is gone)."""

    async def write(self, path: str, value: str, timeout: float) -> None:
        await super().write(path, value, timeout)
        if path == f"/sys/bus/pci/devices/{AUDIO}/driver_override" and value == "vfio-pci":
            devpath = self.sys.devpath(AUDIO)
            self.sys.remove_function(AUDIO)
            self._overrides.pop(AUDIO, None)  # the kernel's struct goes with the device
            self.source.push(self.sys.uevent_props("remove", devpath))


async def test_restoring_writes_nothing_to_a_function_gone_from_the_bus(
        host: SysRoot) -> None:
    """A function that left the bus has no override left to clear: the restoring says so
    and writes nothing to it (it used to write the clearing and read the error back)."""
    sim = LeavesAfterItsOverride(host)
    async with simulated_switch(host, sim=sim) as (w, _sim, _engine, _events):
        with pytest.raises(SwitchFailed) as info:
            await w.switch(NV, "vfio", timeout=10)
    assert f"{AUDIO} gone: no override left to clear" in info.value.restored
    # The switch's own next step found it gone (and failed); the restoring wrote nothing.
    clear = ("write", f"/sys/bus/pci/devices/{AUDIO}/driver_override", "\n")
    assert clear not in sim.record, sim.record


async def test_an_interrupted_switch_rolls_nothing_back_onto_a_failed_card(
        host: SysRoot) -> None:
    """The card fails while the switch writes its override, and the switch is cancelled
    then: the roll-back neither clears that override nor binds the card back to nvidia (no
    module load probes it either); `restored` says the group was left for its recovery."""
    async with simulated_switch(host) as (w, sim, _engine, events):
        override = ("write", f"/sys/bus/pci/devices/{NV}/driver_override", "vfio-pci")
        sim.step_delay = 2.0
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: w.switch(NV, "vfio", timeout=60))
                while override not in sim.record:
                    await anyio.sleep(0.005)
                sim.step_delay = 0.0
                w.source.push(_trouble(host, "failed")[0])
                await _health(w, NV, "failed")
                seen = len(sim.record)
                tg.cancel_scope.cancel()
        after = sim.record[seen:]
        assert _touches(after, NV) == [], after
        assert not [r for r in after if r[:2] == ("command", "modprobe") and "-r" not in r]
        failed = [e for e in events if e.type == "switch-failed"]
        assert [e.error for e in failed] == ["interrupted"]  # type: ignore[attr-defined]
        restored = " ".join(failed[0].restored)  # type: ignore[attr-defined]
        assert f"{NV} is failed" in restored and "recovery" in restored, restored
