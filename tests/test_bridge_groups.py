"""A PCI bridge that shares its IOMMU group with a GPU (a root or downstream port ACS does not
split off) stays on ``pcieport`` in both modes: the kernel's VFIO lets such a group be used
with the bridge where it is (``pcieport`` sets ``driver_managed_dma``; vfio-pci never binds a
bridge). So the bridge makes no group ``mixed``: ``status``, ``mode``, ``group-in-mode`` and
the metrics read the group by its endpoints."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_helpers import Run, simulated_cli
from cli_helpers import run_main as cli

import gpuwatch
from gpuwatch.testing import SysRoot
from gpuwatch.testing.simkernel import SimKernel

pytestmark = pytest.mark.timeout(60)

PORT, GPU, AUDIO = "0000:00:01.0", "0000:01:00.0", "0000:01:00.1"


def bridge_host(root: Path, *, gpu: str | None, audio: str | None,
                port: str | None = "pcieport") -> SysRoot:
    """A root port and the card behind it, all three in IOMMU group 1."""
    s = SysRoot(root)
    s.add_iommu_unit("dmar0")
    s.add_bridge(PORT, iommu_group=1, driver=port)
    s.add_function(GPU, parent=PORT, klass="0x030000", driver=gpu, iommu_group=1)
    s.add_function(AUDIO, parent=PORT, device="0x22ba", klass="0x040300", driver=audio,
                   iommu_group=1)
    return s


def answers(s: SysRoot, capsys: pytest.CaptureFixture[str]) -> tuple[object, ...]:
    """(status's mode, `mode`'s mode, group-in-mode vfio, group-in-mode nvidia)."""
    root = ["--root", str(s.root)]
    code, out, err = cli(capsys, "status", "--json", "--no-daemon", *root)
    assert (code, err) == (0, "")
    status = {g["addr"]: g for g in json.loads(out)["gpus"]}[GPU]
    assert [m["addr"] for m in status["members"]] == [PORT, GPU, AUDIO]
    code, out, err = cli(capsys, "mode", "--addr", GPU, "--json", "--no-daemon", *root)
    assert (code, err) == (0, ""), err
    shown = json.loads(out)["mode"]
    model = gpuwatch.scan(s.root)
    return (status["mode"], shown,
            model.probe("group-in-mode", addr=GPU, mode="vfio"),
            model.probe("group-in-mode", addr=GPU, mode="nvidia"))


@pytest.mark.parametrize(("gpu", "audio", "want"), [
    ("vfio-pci", "vfio-pci", ("vfio", "vfio", True, False)),
    ("nvidia", "snd_hda_intel", ("nvidia", "nvidia", False, True)),
    (None, None, ("unbound", "unbound", False, False)),
    ("nvidia", "vfio-pci", ("mixed", "mixed", False, False)),
])
def test_a_port_on_pcieport_makes_no_group_mixed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], gpu: str | None, audio: str | None,
        want: tuple[object, ...]) -> None:
    assert answers(bridge_host(tmp_path / "h", gpu=gpu, audio=audio), capsys) == want


def test_a_port_on_no_driver_is_left_out_too(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    s = bridge_host(tmp_path / "h", gpu="vfio-pci", audio="vfio-pci", port=None)
    assert answers(s, capsys) == ("vfio", "vfio", True, False)


def test_a_bridge_on_another_driver_still_counts(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Only pcieport's bridges are left where they are: a bridge some other driver holds
    (one without ``driver_managed_dma``) keeps the group from VFIO."""
    s = bridge_host(tmp_path / "h", gpu="vfio-pci", audio="vfio-pci", port="shpchp")
    assert answers(s, capsys) == ("mixed", "mixed", False, False)



def test_plan_and_mode_agree_the_group_is_in_mode(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``mode vfio`` and ``plan vfio`` on a group already on vfio-pci with its port on
    pcieport: both say nothing is to be done, and the port's target is pcieport (no
    driver_override is written for a bridge)."""
    s = bridge_host(tmp_path / "h", gpu="vfio-pci", audio="vfio-pci")
    root = ["--root", str(s.root), "--no-daemon"]
    code, out, err = cli(capsys, "plan", "vfio", "--addr", GPU, "--json", *root)
    assert (code, err) == (0, "gpuwatch: note: already in mode vfio: nothing to write\n")
    plan = json.loads(out)
    assert plan["refused"] is None and plan["steps"] == []
    assert {m["addr"]: m["target"] for m in plan["members"]}[PORT] == "pcieport"
    code, out, err = cli(capsys, "mode", "vfio", "--addr", GPU, *root)
    assert (code, err) == (0, "") and "nothing to do" in out


@pytest.fixture
def switch_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
               ) -> Callable[[SysRoot], tuple[SimKernel, Run]]:
    """`gpuwatch` commands against a host whose kernel is simulated (never the real one)."""

    def make(s: SysRoot) -> tuple[SimKernel, Run]:
        run, sim = simulated_cli(s, monkeypatch, capsys)
        return sim, lambda *argv: run(*argv, "--no-daemon")

    return make


@pytest.mark.parametrize("port", ["pcieport", None])
def test_a_group_with_its_port_switches_both_ways_leaving_the_port(
        tmp_path: Path, port: str | None,
        switch_cli: Callable[[SysRoot], tuple[SimKernel, Run]]
) -> None:
    """The group a consumer board gives its GPU (root port, display, audio): `mode` brings
    the card to vfio-pci and back, completes, and never writes a thing for the port, which
    stays where it was."""
    s = bridge_host(tmp_path / "h", gpu="nvidia", audio="snd_hda_intel", port=port)
    s.add_module("nvidia")
    s.add_module("snd_hda_intel")
    sim, run = switch_cli(s)
    code, out, err = run("plan", "vfio", "--addr", GPU, "--json")
    assert (code, err) == (0, "")
    plan = json.loads(out)
    assert plan["refused"] is None and plan["steps"]
    assert {m["addr"]: m["target"] for m in plan["members"]}[PORT] == "pcieport"
    for direction, drivers in (("vfio", ["vfio-pci", "vfio-pci"]),
                               ("nvidia", ["nvidia", "snd_hda_intel"])):
        code, out, err = run("mode", direction, "--addr", GPU, "--json", "--timeout", "5")
        assert (code, err) == (0, ""), err
        result = json.loads(out)
        assert result["changed"] is True and result["to_mode"] == direction
        members = {m["addr"]: m["driver"] for m in result["members"]}
        assert [members[GPU], members[AUDIO]] == drivers
        assert members[PORT] == (port or "")
    assert sim.writes and not [w for w in sim.writes if PORT in w[0] or w[1] == PORT]


def test_a_group_whose_bridge_is_on_another_driver_is_refused_naming_it(
        tmp_path: Path,
        switch_cli: Callable[[SysRoot], tuple[SimKernel, Run]]
) -> None:
    s = bridge_host(tmp_path / "h", gpu="nvidia", audio="snd_hda_intel", port="shpchp")
    s.add_module("nvidia")
    sim, run = switch_cli(s)
    code, out, err = run("mode", "vfio", "--addr", GPU)
    assert (code, out) == (1, "")
    assert err.startswith(f"gpuwatch: IOMMU group 1 also holds PCI bridge {PORT} (on shpchp): ")
    assert "bind it to pcieport first" in err and len(err.splitlines()) == 1
    assert sim.record == []
