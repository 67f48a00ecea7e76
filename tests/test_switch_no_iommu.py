"""Switching cards that have no IOMMU group (IOMMU off in the firmware or on the command line):
a wedge poisons that card alone, by its address, never every other group-less card.

Every switch runs against a fixture root with the simulated kernel.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest

from gpuwatch.errors import GroupBusy, GroupPoisoned, SwitchRefused, SwitchWedged
from gpuwatch.switch.poison import DEFAULT_POISON_FILE, PoisonEntry, PoisonStore
from gpuwatch.testing import SysRoot
from gpuwatch.testing.simkernel import SimKernel, simulated_switch
from tests.cli_helpers import run_main
from tests.test_switch_engine import drivers, of_type

CARD_A, CARD_B = "0000:01:00.0", "0000:02:00.0"


def iommu_off_host(root: Path) -> SysRoot:
    """Two NVIDIA cards and no IOMMU: no function has a group. Card A is on nouveau, card B
    on no driver; the nvidia module is loaded (no card on it yet)."""
    s = SysRoot(root)
    for port, addr, driver in (("0000:00:01.0", CARD_A, "nouveau"),
                               ("0000:00:02.0", CARD_B, None)):
        s.add_bridge(port)
        s.add_function(addr, parent=port, device="0x2204", driver=driver)
    s.add_module("nouveau")
    s.add_module("nvidia")
    s.set_cmdline("BOOT_IMAGE=/vmlinuz ro quiet")
    s.set_boot_id("5d1c7a3e-2f4b-4c8d-9e6a-0b1c2d3e4f50")
    return s


async def test_a_wedge_on_a_card_without_a_group_poisons_that_card_only(tmp_path: Path) -> None:
    host = iommu_off_host(tmp_path / "h")
    sim = SimKernel(host)
    sim.wedge_unbind.add("nouveau")
    async with simulated_switch(host, sim=sim) as (w, _s, _e, events):
        assert [w.model.function(a).iommu_group for a in (CARD_A, CARD_B)] == [-1, -1]
        with pytest.raises(SwitchWedged, match=f"{CARD_A} .*poisoned") as info:
            await w.switch(CARD_A, "nvidia", timeout=1.0)
        assert "group -1" not in str(info.value)
        # The other group-less card is another device: its switch must go ahead.
        done = await w.switch(CARD_B, "nvidia", timeout=5)
        assert done.changed and drivers(w, CARD_B) == ["nvidia"]
        # The wedged one stays refused, in either direction.
        with pytest.raises(GroupPoisoned, match=CARD_A):
            await w.switch(CARD_A, "nvidia", timeout=1.0)
        refused = of_type(events, "switch-refused")
        assert refused and all(r.addr == CARD_A for r in refused)
    saved = json.loads((host.root / DEFAULT_POISON_FILE).read_text())
    assert list(saved["groups"]) == [CARD_A]
    assert set(PoisonStore(str(host.root)).load()) == {CARD_A}

    async with simulated_switch(host, sim=sim) as (w, _s, _e, _ev):  # a restarted watcher
        assert set(w.model.poisoned) == {CARD_A}
        with pytest.raises(GroupPoisoned):
            await w.switch(CARD_A, "nvidia", timeout=1.0)


def test_an_old_poison_record_under_group_minus_one_names_its_card(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Files written before poison was keyed by address hold group-less wedges under "-1":
    they still refuse the card they name (its `addr`), and only that card."""
    host = iommu_off_host(tmp_path / "h")
    boot = (host.root / "proc/sys/kernel/random/boot_id").read_text().strip()
    path = host.root / DEFAULT_POISON_FILE
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"boot_id": boot, "groups": {"-1": {
        "addr": CARD_A, "to_mode": "nvidia", "error": "write to unbind did not return",
        "time": "2026-12-01T10:00:00Z"}}}))
    assert set(PoisonStore(str(host.root)).load()) == {CARD_A}
    code, _out, err = run_main(capsys, "plan", "nvidia", "--addr", CARD_A, "--root", str(host.root))
    assert code == 1 and "poisoned" in err
    code, out, err = run_main(capsys, "plan", "nvidia", "--addr", CARD_B, "--root", str(host.root),
                             "--json")
    assert code == 0 and json.loads(out)["refused"] is None, err


async def test_recover_of_a_card_without_a_group_says_reboot(tmp_path: Path) -> None:
    """recover rebinds to vfio-pci, which needs an IOMMU group: for a group-less card the
    refusal says so, and the poison stays (only a reboot frees that device)."""
    host = iommu_off_host(tmp_path / "h")
    sim = SimKernel(host)
    sim.wedge_unbind.add("nouveau")
    async with simulated_switch(host, sim=sim) as (w, _s, _e, _ev):
        with pytest.raises(SwitchWedged, match="until the next boot"):
            await w.switch(CARD_A, "nvidia", timeout=1.0)
        sim.release_stuck()
        sim.wedge_unbind.clear()
        with pytest.raises(SwitchRefused, match="no IOMMU group"):
            await w.recover(CARD_A, timeout=5)
        assert CARD_A in w.model.poisoned


def test_mode_shows_the_poison_of_a_card_without_a_group(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host = iommu_off_host(tmp_path / "h")
    PoisonStore(str(host.root)).add(CARD_A, PoisonEntry(
        addr=CARD_A, to_mode="nvidia", error="write to unbind did not return",
        time="2026-12-01T10:00:00Z"))
    code, out, _ = run_main(capsys, "mode", "--addr", CARD_A, "--root", str(host.root))
    assert code == 0 and "poisoned until reboot: write to unbind did not return" in out
    code, out, _ = run_main(capsys, "mode", "--addr", CARD_A, "--json", "--root",
                            str(host.root))
    assert json.loads(out)["poisoned"] == "write to unbind did not return"
    code, out, _ = run_main(capsys, "mode", "--addr", CARD_B, "--json", "--root",
                            str(host.root))
    assert json.loads(out)["poisoned"] is None


def test_a_wedged_card_without_a_group_in_its_mode_is_refused_not_ready(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A wedged card "in mode nvidia" must not read as ready: the early poison check looked
    the card up by its group number, and a group-less card is poisoned by its address, so
    `mode nvidia` said "already nvidia, nothing to do" and exited 0."""
    host = iommu_off_host(tmp_path / "h")
    host.bind(CARD_A, "nvidia")
    PoisonStore(str(host.root)).add(CARD_A, PoisonEntry(
        addr=CARD_A, to_mode="nvidia", error="write to unbind did not return",
        time="2026-12-01T10:00:00Z"))
    code, out, err = run_main(capsys, "mode", "nvidia", "--addr", CARD_A, "--no-daemon",
                              "--root", str(host.root))
    assert code == 1, (out, err)
    assert "write to unbind did not return" in err and "reboot" in err


def test_text_outputs_say_no_iommu_group_not_group_minus_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The JSON keeps ``-1`` (its placeholder for "none"); the text a person reads names
    the card without a group instead of "IOMMU group -1"."""
    host = iommu_off_host(tmp_path / "h")
    root = str(host.root)
    outputs = []
    for argv in (("mode", "--addr", CARD_A), ("plan", "nvidia", "--addr", CARD_A),
                 ("holders", "--addr", CARD_B)):
        code, out, err = run_main(capsys, *argv, "--no-daemon", "--root", root)
        assert code == 0, (argv, out, err)
        outputs.append(out.splitlines()[0])
    assert outputs == [
        f"{CARD_A} (no IOMMU group): host driver",
        f"plan: {CARD_A} (no IOMMU group) host driver -> nvidia",
        f"no process holds a node of {CARD_B} (no IOMMU group)",
    ]
    code, out, _ = run_main(capsys, "plan", "nvidia", "--addr", CARD_A, "--json",
                            "--no-daemon", "--root", root)
    assert json.loads(out)["group"] == -1


async def test_a_busy_card_without_a_group_is_named_by_its_address(tmp_path: Path) -> None:
    host = iommu_off_host(tmp_path / "h")
    lock_dir = host.root / "run/gpuwatch"
    lock_dir.mkdir(parents=True)
    fd = os.open(lock_dir / f"switch-{CARD_A}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process switching card A
        async with simulated_switch(host) as (w, sim, _e, _ev):
            with pytest.raises(GroupBusy) as info:
                await w.switch(CARD_A, "nvidia", timeout=5)
            assert str(info.value) == (f"{CARD_A} (no IOMMU group) is being switched by "
                                       "another process")
            assert sim.record == []
    finally:
        os.close(fd)
