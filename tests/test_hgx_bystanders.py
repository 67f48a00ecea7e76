"""An HGX board with ACS off on its PCIe switches (for GPUDirect RDMA) puts the GPU, the
ConnectX NIC beside it (and on some boards an NVSwitch) in one IOMMU group. Those are the
host's, no part of the card, but the targets stay the public contract's (the class rule:
VFIO for a NIC or NVSwitch in both modes), so the group with its NIC on mlx5_core is
``mixed`` and not in mode nvidia. The safety is a refusal on top, in both directions: a
switch that would take a bystander off its host driver is refused naming it, nothing run,
unless ``--force``; ``recover`` does the whole group; one unbound or on VFIO already is
moved unasked. ``list`` says so in its note."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_helpers import Run, simulated_cli
from cli_helpers import run_main as cli

import gpuwatch
from gpuwatch.errors import SwitchRefused
from gpuwatch.testing import SysRoot
from gpuwatch.testing.machines import (
    BROADCOM,
    NVIDIA,
    NVSWITCH,
    OTHER_BRIDGE_CLASS,
    PEX89000,
    hgx_h100_host,
)
from gpuwatch.testing.simkernel import SimKernel, simulated_switch

pytestmark = pytest.mark.timeout(60)

GPU, NIC, SWITCH = "0000:19:00.0", "0000:1a:00.0", "0000:1b:00.0"
GROUP = 11  # the upstream port's group, which ACS off gives everything behind it
NIC_NAMED = f"{NIC} (class 0x0207, 0x15b3:0x1021, on mlx5_core)"


def no_acs_host(root: Path, *, gpu: str = "nvidia", nic: str = "mlx5_core",
                nvswitch: bool = False) -> SysRoot:
    """One H100 of an HGX board behind a Broadcom switch without ACS: the GPU (on ``gpu``)
    and its NIC (on ``nic``, ``""``: none) in group 11 with the switch's ports, an NVSwitch
    there too with ``nvswitch``; the GPU's ``/dev/nvidia0`` minor known, as the driver
    writes it."""
    s = hgx_h100_host(root, gpus=1, acs=False)
    if nvswitch:
        s.add_bridge("0000:18:02.0", parent="0000:17:00.0", vendor=BROADCOM, device=PEX89000,
                     iommu_group=GROUP)
        s.add_function(SWITCH, parent="0000:18:02.0", vendor=NVIDIA, device=NVSWITCH,
                       klass=OTHER_BRIDGE_CLASS, driver="nvidia-nvswitch", iommu_group=GROUP,
                       subsystem_device="0x1796")
    for addr, driver, was in ((GPU, gpu, "nvidia"), (NIC, nic, "mlx5_core")):
        if driver != was:
            s.unbind(addr)
            if driver:
                s.bind(addr, driver)
    info = s.root / "proc/driver/nvidia/gpus" / GPU
    info.mkdir(parents=True)
    (info / "information").write_text("Model: \t\t NVIDIA H100 80GB HBM3\nDevice Minor: \t 0\n")
    s.add_module("vfio_pci")
    return s


def bystanders(nvswitch: bool) -> dict[str, str]:
    return {NIC: "mlx5_core", **({SWITCH: "nvidia-nvswitch"} if nvswitch else {})}


def drivers(result: dict[str, object]) -> dict[str, str]:
    members = result["members"]
    assert isinstance(members, list)
    return {m["addr"]: m["driver"] for m in members}


@pytest.mark.parametrize("nvswitch", [False, True])
def test_on_nvidia_with_its_nic_on_mlx5_the_group_is_mixed_as_the_contract_says(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], nvswitch: bool) -> None:
    """status, ``mode``, group-in-mode (scan and fresh) and ``plan`` read the contract's
    targets: the NIC's (and NVSwitch's) is vfio-pci in both modes, so the group is
    ``mixed`` and not in mode nvidia (was: ``nvidia``, the NIC's target its own driver);
    ``plan nvidia`` shows the refusal to take them off their drivers, ``--force`` the plan."""
    s = no_acs_host(tmp_path / "h", nvswitch=nvswitch)
    root = ["--root", str(s.root), "--no-daemon"]
    code, out, err = cli(capsys, "status", "--json", *root)
    assert (code, err) == (0, "")
    status = {g["addr"]: g for g in json.loads(out)["gpus"]}[GPU]
    assert {m["addr"] for m in status["members"]} >= {GPU, *bystanders(nvswitch)}
    assert status["mode"] == "mixed"
    code, out, err = cli(capsys, "mode", "--addr", GPU, "--json", *root)
    assert (code, err) == (0, "")
    shown = json.loads(out)
    assert shown["mode"] == "mixed"
    targets = {m["addr"]: (m["nvidia"], m["vfio"]) for m in shown["members"]}
    assert targets[GPU] == ("nvidia", "vfio-pci")
    for addr in bystanders(nvswitch):
        assert targets[addr] == ("vfio-pci", "vfio-pci")
    for mode in ("nvidia", "vfio"):
        assert gpuwatch.scan(s.root).probe("group-in-mode", addr=GPU, mode=mode) is False
        code, out, err = cli(capsys, "probe", "group-in-mode", "--addr", GPU, "--mode", mode,
                             "--fresh", "--root", str(s.root))
        assert (code, json.loads(out)["result"]) == (0, False)
    code, out, err = cli(capsys, "plan", "nvidia", "--addr", GPU, "--json", *root)
    assert code == 1
    plan = json.loads(out)
    assert plan["steps"] == [] and plan["from_mode"] == "mixed"
    assert {m["addr"]: m["target"] for m in plan["members"]}[NIC] == "vfio-pci"
    reason = plan["refused"]["reason"]
    assert reason.startswith(f"IOMMU group {GROUP} also holds {NIC_NAMED}")
    assert (f"{SWITCH} (class 0x0680, 0x10de:0x22a3, on nvidia-nvswitch)" in reason) == nvswitch
    assert "mode nvidia wants them on vfio-pci" in reason
    # What the host would lose, named by what the bystanders are.
    lost = "its network and its NVLink fabric" if nvswitch else "its network"
    assert f"would unbind them from the host ({lost}); " in reason
    assert reason.endswith("enable ACS to split the group, or pass --force to move them too")
    code, out, err = cli(capsys, "plan", "nvidia", "--addr", GPU, "--json", "--force", *root)
    assert code == 0 and json.loads(out)["refused"] is None
    assert [step for step in json.loads(out)["steps"] if step["kind"] == "write"
            and step["path"].endswith("/sys/bus/pci/drivers/mlx5_core/unbind")
            and step["value"] == NIC]


SwitchCli = Callable[[SysRoot], tuple[SimKernel, Run]]


@pytest.fixture
def switch_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
               ) -> SwitchCli:
    """`gpuwatch` commands against a host whose kernel is simulated (never the real one)."""

    def make(s: SysRoot) -> tuple[SimKernel, Run]:
        run, sim = simulated_cli(s, monkeypatch, capsys)
        return sim, lambda *argv: run(*argv, "--no-daemon")

    return make


def test_the_way_back_to_nvidia_is_refused_while_the_nic_is_on_mlx5(
        tmp_path: Path, switch_cli: SwitchCli) -> None:
    """The GPU on vfio-pci, its NIC on mlx5_core: ``mode nvidia`` would take the NIC to
    vfio-pci (its target in nvidia, as the contract says): refused, nothing run (was:
    completed with the NIC left on mlx5_core, the group reported in mode nvidia). With
    ``--force`` it completes, the NIC on vfio-pci, and the group is in mode nvidia."""
    s = no_acs_host(tmp_path / "h", gpu="vfio-pci")
    sim, run = switch_cli(s)
    code, out, err = run("plan", "nvidia", "--addr", GPU, "--json")
    assert code == 1
    reason = json.loads(out)["refused"]["reason"]
    assert reason.startswith(f"IOMMU group {GROUP} also holds {NIC_NAMED}")
    code, out, err = run("mode", "nvidia", "--addr", GPU)
    assert (code, out) == (1, "") and err == f"gpuwatch: {reason}\n"
    assert sim.record == []
    code, out, err = run("mode", "nvidia", "--addr", GPU, "--force", "--json", "--timeout", "5")
    assert (code, err) == (0, ""), err
    result = json.loads(out)
    assert result["changed"] is True
    assert (drivers(result)[GPU], drivers(result)[NIC]) == ("nvidia", "vfio-pci")
    assert ("/sys/bus/pci/drivers/mlx5_core/unbind", NIC) in sim.writes
    assert gpuwatch.scan(s.root).probe("group-in-mode", addr=GPU, mode="nvidia") is True


@pytest.mark.parametrize("nvswitch", [False, True])
def test_vfio_is_refused_naming_them_unless_forced(
        tmp_path: Path, switch_cli: SwitchCli, capsys: pytest.CaptureFixture[str],
        nvswitch: bool) -> None:
    """VFIO takes the whole group: the switch would unbind the NIC (and the NVSwitch) from
    the host. Refused, nothing run, naming each; ``--force`` moves them too; ``list``
    says so in its note."""
    s = no_acs_host(tmp_path / "h", nvswitch=nvswitch)
    code, out, err = cli(capsys, "list", "--json", "--no-daemon", "--root", str(s.root))
    note = {g["addr"]: g for g in json.loads(out)}[GPU]["note"]
    for addr, driver in bystanders(nvswitch).items():
        assert (f"; {addr} (on {driver}) shares the IOMMU group but is no part of the card: "
                "passing the group through takes it from the host") in note
    sim, run = switch_cli(s)
    code, out, err = run("plan", "vfio", "--addr", GPU, "--json")
    assert code == 1
    reason = json.loads(out)["refused"]["reason"]
    assert reason.startswith(f"IOMMU group {GROUP} also holds {NIC_NAMED}")
    assert (f"{SWITCH} (class 0x0680" in reason) == nvswitch
    assert "mode vfio wants them on vfio-pci" in reason
    assert "pass --force to move them too" in reason
    code, out, err = run("mode", "vfio", "--addr", GPU)
    assert (code, out) == (1, "") and err == f"gpuwatch: {reason}\n"
    assert sim.record == []
    code, out, err = run("mode", "vfio", "--addr", GPU, "--force", "--json", "--timeout", "5")
    assert (code, err) == (0, ""), err
    members = drivers(json.loads(out))
    assert {members[a] for a in (GPU, *bystanders(nvswitch))} == {"vfio-pci"}


async def test_the_daemon_refuses_both_ways_and_recover_does_the_whole_group(
        tmp_path: Path) -> None:
    """The daemon's engine (socket ``plan`` and ``switch``) refuses as the CLI does, in both
    directions, with a ``switch-refused`` event and nothing run; ``force`` moves the NIC;
    ``recover`` (which forces) rebinds the whole group to VFIO."""
    s = no_acs_host(tmp_path / "h", gpu="vfio-pci")
    async with simulated_switch(s) as (_w, sim, engine, events):
        plan = await engine.plan(GPU, "nvidia")
        assert plan["refused"]["reason"].startswith(f"IOMMU group {GROUP} also holds "
                                                    f"{NIC_NAMED}")
        with pytest.raises(SwitchRefused, match=f"also holds {NIC}"):
            await engine.switch(GPU, "nvidia", timeout=10)
        assert sim.record == []
        assert [e for e in events if getattr(e, "type", "") == "switch-refused"]
        result = await engine.switch(GPU, "nvidia", timeout=10, force=True)
        assert {m.addr: m.driver for m in result.members}[NIC] == "vfio-pci"
    s = no_acs_host(tmp_path / "h2")
    async with simulated_switch(s) as (_w, sim, engine, _events):
        with pytest.raises(SwitchRefused, match="mode vfio wants them on vfio-pci"):
            await engine.switch(GPU, "vfio", timeout=10)
        assert sim.record == []
        result = await engine.recover(GPU, timeout=10)
        got = {m.addr: m.driver for m in result.members}
        assert (got[GPU], got[NIC]) == ("vfio-pci", "vfio-pci")


@pytest.mark.parametrize(("gpu", "nic", "mode"), [
    ("nvidia", "", "vfio"),
    ("vfio-pci", "", "nvidia"),
    ("vfio-pci", "vfio-pci", "nvidia"),
])
def test_a_bystander_unbound_or_on_vfio_is_moved_unasked(
        tmp_path: Path, switch_cli: SwitchCli, gpu: str, nic: str, mode: str) -> None:
    """Nothing is taken from the host when the NIC is on no driver or on VFIO already: the
    switch completes without ``--force``, the NIC on its contract target, vfio-pci."""
    s = no_acs_host(tmp_path / "h", gpu=gpu, nic=nic)
    sim, run = switch_cli(s)
    code, out, err = run("mode", mode, "--addr", GPU, "--json", "--timeout", "5")
    assert (code, err) == (0, ""), err
    got = drivers(json.loads(out))
    assert (got[GPU], got[NIC]) == ("nvidia" if mode == "nvidia" else "vfio-pci", "vfio-pci")
    if nic:  # already where nvidia wants it: nothing written for it
        assert not [w for w in sim.writes if NIC in w[0] or w[1] == NIC]


def test_a_cards_own_usb_c_still_goes_to_vfio_in_nvidia(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    """Only functions outside every display function's slot are bystanders: the card's own
    USB-C controller (same slot, 01:00.2) keeps its documented nvidia-mode target, VFIO."""
    from gpuwatch.testing.machines import turing_desktop_host

    s = turing_desktop_host(tmp_path / "h")
    code, out, err = cli(capsys, "mode", "--addr", "0000:01:00.0", "--json", "--no-daemon",
                         "--root", str(s.root))
    assert (code, err) == (0, "")
    shown = json.loads(out)
    assert shown["mode"] == "mixed"
    assert {m["addr"]: m["nvidia"] for m in shown["members"]}["0000:01:00.2"] == "vfio-pci"


def test_the_refusal_names_what_the_host_would_lose_by_class() -> None:
    """A DG2 card's audio function behind a switch without ACS is its audio, not a network
    or storage: the refusal says what each bystander is to the host."""
    from gpuwatch.core.plan import VfioTarget, bystanders_reason
    from gpuwatch.core.results import PciFunction

    def fn(addr: str, class_: str, driver: str) -> PciFunction:
        return PciFunction.model_validate({
            "addr": addr, "class": class_, "class_label": "", "vendor_id": "0x8086",
            "device_id": "0x4f92", "driver": driver, "iommu_group": 3})

    vfio = VfioTarget(driver="vfio-pci")
    cases = {
        "0x040300": "its audio",
        "0x010802": "its storage",
        "0x0c0330": "its USB",
        "0x048000": "its multimedia",
        "0xff0000": "a device it uses",
    }
    for class_, lost in cases.items():
        reason = bystanders_reason(3, "vfio", [(fn("0000:04:00.0", class_, "x"), vfio)])
        assert f"from the host ({lost}); " in reason, reason
    both = bystanders_reason(3, "vfio", [(fn("0000:04:00.0", "0x020000", "ixgbe"), vfio),
                                         (fn("0000:05:00.0", "0x020000", "ixgbe"), vfio),
                                         (fn("0000:06:00.0", "0x010802", "nvme"), vfio)])
    assert "from the host (its network and its storage); " in both
