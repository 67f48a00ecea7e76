"""An HGX board with ACS off on its PCIe switches (for GPUDirect RDMA) puts the GPU, the
ConnectX NIC beside it (and on some boards an NVSwitch) in one IOMMU group. Those are the
host's, no part of the card: the way to nvidia leaves them on their drivers (the group is in
mode nvidia with them there), and the way to vfio, which would take them from the host with
the group, is refused naming them unless ``--force``; ``list`` says so in its note."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_helpers import Run, simulated_cli
from cli_helpers import run_main as cli

import gpuwatch
from gpuwatch.testing import SysRoot
from gpuwatch.testing.machines import (
    BROADCOM,
    NVIDIA,
    NVSWITCH,
    OTHER_BRIDGE_CLASS,
    PEX89000,
    hgx_h100_host,
)
from gpuwatch.testing.simkernel import SimKernel

pytestmark = pytest.mark.timeout(60)

GPU, NIC, SWITCH = "0000:19:00.0", "0000:1a:00.0", "0000:1b:00.0"
GROUP = 11  # the upstream port's group, which ACS off gives everything behind it


def no_acs_host(root: Path, *, gpu: str = "nvidia", nvswitch: bool = False) -> SysRoot:
    """One H100 of an HGX board behind a Broadcom switch without ACS: the GPU and its NIC
    (``mlx5_core``) in group 11 with the switch's ports, an NVSwitch there too with
    ``nvswitch``; the GPU's ``/dev/nvidia0`` minor known, as the driver writes it."""
    s = hgx_h100_host(root, gpus=1, acs=False)
    if nvswitch:
        s.add_bridge("0000:18:02.0", parent="0000:17:00.0", vendor=BROADCOM, device=PEX89000,
                     iommu_group=GROUP)
        s.add_function(SWITCH, parent="0000:18:02.0", vendor=NVIDIA, device=NVSWITCH,
                       klass=OTHER_BRIDGE_CLASS, driver="nvidia-nvswitch", iommu_group=GROUP,
                       subsystem_device="0x1796")
    if gpu != "nvidia":
        s.unbind(GPU)
        s.bind(GPU, gpu)
    info = s.root / "proc/driver/nvidia/gpus" / GPU
    info.mkdir(parents=True)
    (info / "information").write_text("Model: \t\t NVIDIA H100 80GB HBM3\nDevice Minor: \t 0\n")
    s.add_module("vfio_pci")
    return s


def bystanders(nvswitch: bool) -> dict[str, str]:
    return {NIC: "mlx5_core", **({SWITCH: "nvidia-nvswitch"} if nvswitch else {})}


@pytest.mark.parametrize("nvswitch", [False, True])
def test_on_nvidia_the_group_is_in_mode_nvidia_with_its_nic_on_mlx5(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], nvswitch: bool) -> None:
    """status, ``mode``, group-in-mode (scan and fresh) and ``plan nvidia`` agree: nothing
    to do, and the NIC's (and NVSwitch's) target in nvidia is the driver it is on (was:
    ``mixed``, and a plan that unbound mlx5_core and nvidia-nvswitch for vfio-pci)."""
    s = no_acs_host(tmp_path / "h", nvswitch=nvswitch)
    root = ["--root", str(s.root), "--no-daemon"]
    code, out, err = cli(capsys, "status", "--json", *root)
    assert (code, err) == (0, "")
    status = {g["addr"]: g for g in json.loads(out)["gpus"]}[GPU]
    assert {m["addr"] for m in status["members"]} >= {GPU, *bystanders(nvswitch)}
    assert status["mode"] == "nvidia"
    code, out, err = cli(capsys, "mode", "--addr", GPU, "--json", *root)
    assert (code, err) == (0, "")
    shown = json.loads(out)
    assert shown["mode"] == "nvidia"
    targets = {m["addr"]: (m["nvidia"], m["vfio"]) for m in shown["members"]}
    for addr, driver in bystanders(nvswitch).items():
        assert targets[addr] == (driver, "vfio-pci")
    assert gpuwatch.scan(s.root).probe("group-in-mode", addr=GPU, mode="nvidia") is True
    code, out, err = cli(capsys, "probe", "group-in-mode", "--addr", GPU, "--mode", "nvidia",
                         "--fresh", "--root", str(s.root))
    assert (code, json.loads(out)["result"]) == (0, True)
    code, out, err = cli(capsys, "plan", "nvidia", "--addr", GPU, "--json", *root)
    assert (code, err) == (0, "gpuwatch: note: already in mode nvidia: nothing to write\n")
    assert json.loads(out)["steps"] == []


SwitchCli = Callable[[SysRoot], tuple[SimKernel, Run]]


@pytest.fixture
def switch_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
               ) -> SwitchCli:
    """`gpuwatch` commands against a host whose kernel is simulated (never the real one)."""

    def make(s: SysRoot) -> tuple[SimKernel, Run]:
        run, sim = simulated_cli(s, monkeypatch, capsys)
        return sim, lambda *argv: run(*argv, "--no-daemon")

    return make


def test_the_way_back_to_nvidia_moves_the_gpu_alone(tmp_path: Path, switch_cli: SwitchCli) -> None:
    """The GPU on vfio-pci, its NIC on mlx5_core: ``mode nvidia`` brings the GPU to nvidia,
    completes, and writes nothing for the NIC (was: unbound from mlx5_core, bound to
    vfio-pci: the host's RDMA link gone)."""
    s = no_acs_host(tmp_path / "h", gpu="vfio-pci")
    sim, run = switch_cli(s)
    code, out, err = run("mode", "nvidia", "--addr", GPU, "--json", "--timeout", "5")
    assert (code, err) == (0, ""), err
    result = json.loads(out)
    assert result["changed"] is True
    members = {m["addr"]: m["driver"] for m in result["members"]}
    assert (members[GPU], members[NIC]) == ("nvidia", "mlx5_core")
    assert sim.writes and not [w for w in sim.writes if NIC in w[0] or w[1] == NIC]


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
    assert reason.startswith(f"IOMMU group {GROUP} also holds {NIC} (class 0x0207, "
                             "0x15b3:0x1021, on mlx5_core)")
    assert (f"{SWITCH} (class 0x0680" in reason) == nvswitch
    assert "pass --force to move them to VFIO too" in reason
    code, out, err = run("mode", "vfio", "--addr", GPU)
    assert (code, out) == (1, "") and err == f"gpuwatch: {reason}\n"
    assert sim.record == []
    code, out, err = run("mode", "vfio", "--addr", GPU, "--force", "--json", "--timeout", "5")
    assert (code, err) == (0, ""), err
    members = {m["addr"]: m["driver"] for m in json.loads(out)["members"]}
    assert {members[a] for a in (GPU, *bystanders(nvswitch))} == {"vfio-pci"}


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
