"""A group that holds every display of the host is the host's console, however many there
are: two cards behind one root port without ACS, the boot display one of them, and no
other display on the host. Passing that group through leaves the host with no screen,
exactly as passing a single boot display would; two cards in two groups leave one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import reports_every_way, simulated_cli

import gpuwatch
from gpuwatch.core.hostkeep import kept_for_host_reason
from gpuwatch.core.results import PciFunction
from gpuwatch.testing import SysRoot

PORT, PORT2 = "0000:00:01.0", "0000:00:01.1"
GPU, AUDIO, GPU2 = "0000:01:00.0", "0000:01:00.1", "0000:02:00.0"


def two_cards(root: Path, *, shared: bool, boot_vga: bool = True,
              framebuffer: bool = False) -> SysRoot:
    """Two NVIDIA cards, the first with its audio; ``shared``: both in IOMMU group 1 (no ACS
    on the ports), else the second in group 2. The first is the boot display (``boot_vga``)
    or, with none, carries the framebuffer console (``framebuffer``)."""
    s = SysRoot(root)
    s.add_iommu_unit("dmar0")
    s.add_bridge(PORT, iommu_group=1, driver="pcieport")
    s.add_bridge(PORT2, iommu_group=1 if shared else 2, driver="pcieport")
    s.add_function(GPU, parent=PORT, klass="0x030000", driver="nvidia", iommu_group=1)
    s.add_function(AUDIO, parent=PORT, device="0x22ba", klass="0x040300",
                   driver="snd_hda_intel", iommu_group=1)
    s.add_function(GPU2, parent=PORT2, device="0x2204", klass="0x030000", driver="nvidia",
                   iommu_group=1 if shared else 2)
    if boot_vga:
        s.set_attr(GPU, "boot_vga", "1\n")
    if framebuffer:
        s.add_framebuffer("fb0", GPU)
    s.add_module("nvidia")
    return s


def display(addr: str, group: int) -> PciFunction:
    return PciFunction(addr=addr, vendor_id="0x10de", device_id="0x2204", class_="0x0300",
                       class_label="", driver="nvidia", iommu_group=group)


def test_rule_a_group_of_every_display_is_kept() -> None:
    both = [display(GPU, 1), display(GPU2, 1)]
    reason = kept_for_host_reason(both, console_drivers=(), boot_vga={GPU},
                                  host_displays=[GPU, GPU2])
    assert GPU in reason and GPU2 in reason and "every display function" in reason
    reason = kept_for_host_reason(both, console_drivers=(), boot_vga=(),
                                  host_displays=[GPU, GPU2], framebuffers={GPU})
    assert "framebuffer" in reason and "every display function" in reason
    # A third display elsewhere keeps the host a screen: the group may go.
    assert kept_for_host_reason(both, console_drivers=(), boot_vga={GPU},
                                host_displays=[GPU, GPU2, "0000:00:02.0"]) == ""
    # The old wording stays for the one-display case.
    assert "its only display function" in kept_for_host_reason(
        [display(GPU, 1)], console_drivers=(), boot_vga={GPU}, host_displays=[GPU])


@pytest.mark.parametrize("captured", [False, True])
@pytest.mark.parametrize(("shared", "kept"), [(True, True), (False, False)])
async def test_every_report_keeps_the_group_of_every_display(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        captured: bool, shared: bool, kept: bool) -> None:
    """The model, `list` and `status` every way they answer (the stdlib reports, which
    otherwise read no ``boot_vga`` on a host of two displays, and the full ones, with and
    without a daemon), and the switch, which refuses the group unless forced."""
    s = two_cards(tmp_path / "h", shared=shared)
    if captured:
        s.capture()
    model = gpuwatch.scan(s.root)
    assert bool(model.kept_for_host(GPU2)) is kept
    for said in await reports_every_way(capsys, monkeypatch, str(s.root), text=True):
        listed = {g["addr"]: g for g in said.listed}
        assert [listed[a]["kept_for_host"] for a in (GPU, GPU2)] == [kept, kept], (
            said.where, said.full)
        hostdevs = [f["hostdev_xml"] for g in said.listed for f in g["functions"]]
        assert (None in hostdevs) is kept
        assert [g["kept_for_host"] for g in said.status["gpus"]] == [kept, kept], said.where
        assert said.text is not None
        assert ("<hostdev" in said.text) is not kept
    run, sim = simulated_cli(s, monkeypatch, capsys)
    code, out, _ = run("plan", "vfio", "--addr", GPU2, "--json", "--no-daemon")
    refused = json.loads(out)["refused"]
    assert (code == 1 and "every display function" in refused["reason"]) is kept
    assert sim.record == []


async def test_a_framebuffer_console_on_a_group_of_every_display_is_kept(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``boot_vga`` (a 3D controller took the console over from the firmware's
    framebuffer): the fbN device beneath the first card keeps the group all the same."""
    s = two_cards(tmp_path / "h", shared=True, boot_vga=False, framebuffer=True)
    assert "framebuffer" in gpuwatch.scan(s.root).kept_for_host(GPU2)
    for said in await reports_every_way(capsys, monkeypatch, str(s.root)):
        assert [g["kept_for_host"] for g in said.listed] == [True, True], said.where
