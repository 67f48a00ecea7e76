"""The record of a killed switch (``run/gpuwatch/switch-<group>.json``) once its card is in
another IOMMU group than the one it is keyed by (removed and added again, which may renumber
the group; a no-IOMMU group that came or went).

The card's next switch or `recover` adopts it by its members, whatever its key: reports it
if nothing did yet, clears the overrides it may have left on the group's functions (those
only), and removes it. A group that gets the old number later is another card's: a record
under its number naming none of its functions is not its own to report, clear or drop.

Every switch runs against a fixture root with the simulated kernel; the `gpuwatch recover`
test runs a real process.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from daemon_helpers import env, gpuwatch_cmd
from pydantic import BaseModel

from gpuwatch.hostfs.bootstate import boot_id
from gpuwatch.hostfs.journal import LOCK_DIR, Journal, journal_keys, read_journal, write_journal
from gpuwatch.testing import SysRoot
from gpuwatch.testing.simkernel import (
    SIMKERNEL_ENV,
    SimKernel,
    save_for_subprocess,
    simulated_switch,
)
from gpuwatch.watch.eventlog import read_events
from tests.test_switch_engine import AUDIO, AUDIO2, NV, NV2, add_second_card, drivers, of_type
from tests.test_switch_engine import to_vfio as card_to_vfio

pytestmark = pytest.mark.timeout(60)

#: A pid no process of this namespace has (above the kernel's PID_MAX_LIMIT): the killed one.
GONE_PID = 4_194_305
#: A function the killed switch planned that did not come back.
GONE = "0000:01:00.2"
OVR = "/sys/bus/pci/devices/{}/driver_override"


def leave_record(host: SysRoot, key: int | str, addr: str, members: tuple[str, ...], *,
                 group: int = 13, reported: bool = False) -> None:
    """What a switch of ``addr``'s group ``group`` to vfio, killed half-way, leaves."""
    folder = host.root / LOCK_DIR
    folder.mkdir(parents=True, exist_ok=True)
    write_journal(str(folder), key, boot_id(str(host.root)), Journal(
        addr=addr, group=group, from_mode="nvidia", to_mode="vfio", members=members,
        pid=GONE_PID, started="2026-01-01T00:00:00Z", reported=reported))


def records(host: SysRoot) -> dict[int | str, Journal]:
    folder, boot = str(host.root / LOCK_DIR), boot_id(str(host.root))
    found = {k: read_journal(folder, k, boot) for k in journal_keys(folder)}
    return {k: j for k, j in found.items() if j is not None}


def pin(host: SysRoot, sim: SimKernel, addr: str) -> None:
    """``addr`` pinned to vfio-pci by a driver_override nobody cleared."""
    sim._overrides[addr] = "vfio-pci"
    host.set_attr(addr, "driver_override", "vfio-pci\n")


def renumbered_on_vfio(host: SysRoot) -> SimKernel:
    """The card on vfio-pci in group 16 now, its audio function still pinned."""
    card_to_vfio(host)
    host.set_iommu_group(NV, 16)
    host.set_iommu_group(AUDIO, 16)
    sim = SimKernel(host)
    pin(host, sim, AUDIO)
    return sim


def writes(sim: SimKernel) -> list[tuple[str, str]]:
    return [(r[1], r[2]) for r in sim.record if r[0] == "write"]


def abandoned(events: list[BaseModel]) -> list[int]:
    return [e.group for e in of_type(events, "switch-failed")
            if e.error.startswith("abandoned: ")]


@pytest.mark.parametrize("how", ["recover", "mode"])
async def test_the_card_s_switch_adopts_a_record_under_its_old_group_number(
        host: SysRoot, how: str) -> None:
    """Killed while the card was in group 13 (a `gpuwatch mode` beside this watcher), the
    card now in group 16: its `recover` or `mode vfio` reports that switch's end once,
    clears the overrides of the group's functions it may have pinned (not the one that is
    gone), and removes the record; the next one finds nothing more."""
    sim = renumbered_on_vfio(host)
    async with simulated_switch(host, sim=sim) as (w, _s, _e, events):
        leave_record(host, 13, NV, (NV, AUDIO, GONE))
        result = await (w.recover(NV, timeout=5) if how == "recover"
                        else w.switch(NV, "vfio", timeout=5))
        assert result.group == 16 and drivers(w, NV, AUDIO) == ["vfio-pci"] * 2
        assert (OVR.format(AUDIO), "\n") in writes(sim), sim.record
        assert not [w_ for w_ in writes(sim) if GONE in w_[0] or w_[1] == GONE]
        assert sim.overrides == {}
        assert abandoned(events) == [13]
        assert records(host) == {}
        before = len(sim.record)
        again = await w.recover(NV, timeout=5)
        assert not again.changed and len(sim.record) == before
        assert abandoned(events) == [13]  # once


async def test_non_root_in_mode_is_told_of_the_adopted_record(host: SysRoot) -> None:
    """As non-root, `mode vfio` answers in mode and says the killed switch may have left an
    override, though the record is keyed by the card's old group number."""
    sim = renumbered_on_vfio(host)
    leave_record(host, 13, NV, (NV, AUDIO), reported=True)
    async with simulated_switch(host, sim=sim, euid=1000) as (w, _s, _e, _ev):
        result = await w.switch(NV, "vfio", timeout=5)
        assert not result.changed
        assert any("driver_override" in n for n in result.notes), result.notes
    assert 13 in records(host)  # a non-root answer clears nothing


def two_cards_on_vfio(host: SysRoot) -> SimKernel:
    """The example card (group 13) on nvidia; a second card on vfio-pci in group 15, its
    audio function pinned by a switch killed when that card had group 13 (it was removed and
    added again since, and the example card got 13)."""
    add_second_card(host, "vfio-pci", "vfio-pci")
    host.add_vfio_group(15)
    sim = SimKernel(host)
    pin(host, sim, AUDIO2)
    leave_record(host, 13, NV2, (NV2, AUDIO2), reported=True)
    return sim


async def test_a_group_given_the_old_number_leaves_the_other_card_s_record_alone(
        host: SysRoot) -> None:
    """Group 13 is the example card's now: its switches neither clear the other card's
    overrides nor take its record for their own (`plan` shows no such write, a non-root
    in-mode answer no such note); the record stays where the other card's `recover`, in
    group 15, finds it, clears its pin and removes it."""
    sim = two_cards_on_vfio(host)
    async with simulated_switch(host, sim=sim) as (w, _s, engine, events):
        plan = await engine.plan(NV, "vfio")
        assert not [s for s in plan["steps"] if NV2 in s.get("path", "")
                    or AUDIO2 in s.get("path", "")], plan["steps"]
        done = await w.switch(NV, "vfio", timeout=5)
        assert done.changed and done.group == 13
        back = await w.switch(NV, "nvidia", timeout=5)
        assert back.changed
        touched = [w_ for w_ in writes(sim) if NV2 in w_[0] + w_[1] or AUDIO2 in w_[0] + w_[1]]
        assert touched == []
        assert not any("killed" in n for n in done.notes + back.notes), done.notes
        assert [j.members for j in records(host).values()] == [(NV2, AUDIO2)]
        assert sim.overrides[AUDIO2] == "vfio-pci"
        recovered = await w.recover(NV2, timeout=5)
        assert recovered.group == 15
        assert (OVR.format(AUDIO2), "\n") in writes(sim)
        assert AUDIO2 not in sim.overrides
        assert records(host) == {}
        assert abandoned(events) == []  # reported before (by a watcher's start)


async def test_non_root_in_mode_answer_of_the_new_group_has_no_note(host: SysRoot) -> None:
    """The example card on vfio in group 13, another card's record under 13: `mode vfio` as
    non-root is a plain in-mode answer, not a warning about a switch of another card."""
    card_to_vfio(host)
    sim = two_cards_on_vfio(host)
    async with simulated_switch(host, sim=sim, euid=1000) as (w, _s, _e, _ev):
        result = await w.switch(NV, "vfio", timeout=5)
        assert result.notes == ["already in mode vfio: nothing written"], result.notes


@pytest.mark.timeout(120)
def test_recover_cli_adopts_the_record_under_the_old_number(host: SysRoot,
                                                            tmp_path: Path) -> None:
    """The same through `gpuwatch recover` processes: exit 0, the pin cleared, the record
    gone, the end of the killed switch in the log once."""
    sim = renumbered_on_vfio(host)
    leave_record(host, 13, NV, (NV, AUDIO))
    saved, log = tmp_path / "simkernel.pickle", tmp_path / "events.jsonl"
    save_for_subprocess(sim, saved)

    def recover() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            gpuwatch_cmd("recover", "--addr", NV, "--root", str(host.root), "--timeout", "30",
                         "--log", str(log)),
            capture_output=True, text=True, timeout=90, env={**env(), SIMKERNEL_ENV: str(saved)})

    first = recover()
    assert first.returncode == 0, first.stderr
    path = host.root / "sys/bus/pci/devices" / AUDIO / "driver_override"
    assert path.read_text().strip() == "(null)"
    assert records(host) == {}
    second = recover()
    assert second.returncode == 0, second.stderr
    failed = [e for e in read_events(log) if e["type"] == "switch-failed"]
    assert [(e["group"], e["error"].split(":")[0]) for e in failed] == [(13, "abandoned")]
    assert "Traceback" not in first.stderr + second.stderr
