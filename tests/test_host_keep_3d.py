"""A 3D controller with no framebuffer is no screen the host could fall back on.

An Optimus laptop (the Intel iGPU drives the panel, the NVIDIA dGPU is a 3D controller,
class 0x0302, with no outputs) and a desktop whose iGPU holds the console beside an
A100/H100/L4 have one screen: the iGPU's. Its group is kept for the host, as a single
boot display is; the 3D controller is offered. A GeForce that is a VGA controller (0x0300)
is a second screen, so neither is kept; and a 3D controller with a framebuffer beneath it
(nvidia-drm's fbdev emulation) is a screen too. The model, the reports on a daemon's answers
and the stdlib reports answer alike, on a tree as Linux lays it out and on its captured copy.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from cli_helpers import reports_every_way, simulated_cli
from watch_helpers import count_calls, watching

import gpuwatch
from gpuwatch.core.hostkeep import is_3d_controller, kept_for_host_reason, own_displays
from gpuwatch.core.results import PciFunction
from gpuwatch.hostfs import bootvga
from gpuwatch.hostfs.scan import read_console
from gpuwatch.testing import SysRoot
from gpuwatch.testing.machines import H100_PCIE, headless_compute_host, hybrid_laptop_host

pytestmark = pytest.mark.timeout(120)

IGPU, DGPU, L4 = "0000:00:02.0", "0000:01:00.0", "0000:03:00.0"
BOOT_REASON = (f"{IGPU} is the host's boot display (boot_vga 1) and its only display function: "
               "passing it through leaves the host without a console")
FB_REASON = "carries the host's framebuffer console"


def optimus(root: Path) -> SysRoot:
    """The iGPU (boot_vga 1) beside the NVIDIA 3D controller, no framebuffer on it."""
    return hybrid_laptop_host(root)


def geforce_vga(root: Path) -> SysRoot:
    """The same laptop with the dGPU a VGA controller (a MUXed GeForce): a second screen."""
    return hybrid_laptop_host(root, dgpu_class="0x030000")


def optimus_dgpu_fb(root: Path) -> SysRoot:
    """The Optimus laptop with nvidia-drm's fbdev emulation on the 3D controller (fb0)."""
    s = hybrid_laptop_host(root)
    s.add_framebuffer("fb0", DGPU, fb_name="nvidia-drmdrmfb")
    return s


def optimus_igpu_fb(root: Path) -> SysRoot:
    """The Optimus laptop with i915's fb0 on the iGPU too: the boot_vga reason wins."""
    return hybrid_laptop_host(root, fbdev=True)


def h100_console(root: Path) -> SysRoot:
    """A compute node whose only display is an H100 with a framebuffer beneath it."""
    s = headless_compute_host(root)
    s.add_framebuffer("fb0", H100_PCIE, fb_name="nvidia-drmdrmfb")
    return s


#: fixture → {GPU: its reason}.
MACHINES: dict[str, tuple[Callable[[Path], SysRoot], dict[str, str]]] = {
    "igpu+3d": (optimus, {IGPU: BOOT_REASON, DGPU: ""}),
    "igpu+3d, fb0 on the igpu": (optimus_igpu_fb, {IGPU: BOOT_REASON, DGPU: ""}),
    "igpu+vga geforce": (geforce_vga, {IGPU: "", DGPU: ""}),
    "igpu+3d carrying fb0": (optimus_dgpu_fb, {IGPU: "", DGPU: ""}),
    "only a 3d controller, with fb0": (h100_console, {
        H100_PCIE: (f"{H100_PCIE} {FB_REASON} (a graphics fbN device) and is its only display "
                    "function: passing it through leaves the host without a console")}),
}


def fn(addr: str, klass: str, group: int) -> PciFunction:
    return PciFunction(addr=addr, vendor_id="0x10de", device_id="0x25a2", class_=klass,
                       class_label="", driver="nvidia", iommu_group=group)


# ------------------------------------------------------------ the rule, pure


def test_a_3d_controller_is_a_screen_only_with_a_framebuffer() -> None:
    gpus = [(IGPU, "", "0x0300"), (DGPU, "", "0x0302"), ("0000:02:00.0", "", "0x0380"),
            ("0000:03:00.0", "", "0x0301"), ("0000:01:00.1", DGPU, "0x0302")]
    assert list(own_displays(gpus)) == [IGPU, "0000:02:00.0", "0000:03:00.0"]
    assert list(own_displays(gpus, {DGPU, "0000:01:00.1"})) == [
        IGPU, DGPU, "0000:02:00.0", "0000:03:00.0"]  # a VF stays out, framebuffer or not
    assert is_3d_controller("0x0302") and is_3d_controller("0x030200")
    assert not any(is_3d_controller(k) for k in ("0x0300", "0x0301", "0x0380", "0x0400"))
    igpu = fn(IGPU, "0x0300", 0)
    pair = [(IGPU, "", "0x0300"), (DGPU, "", "0x0302")]
    assert kept_for_host_reason([igpu], console_drivers=(), boot_vga={IGPU},
                                host_displays=own_displays(pair)) == BOOT_REASON
    assert kept_for_host_reason([igpu], console_drivers=(), boot_vga={IGPU},
                                host_displays=own_displays(pair, {DGPU}),
                                framebuffers={DGPU}) == ""


# ------------------------------------------------------------ the model and every report


@pytest.mark.parametrize("captured", [False, True])
@pytest.mark.parametrize("machine", sorted(MACHINES))
async def test_every_path_keeps_the_only_screen(
        tmp_path: Path, machine: str, captured: bool, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The model, `list --json` and `status --json` every way they answer (the stdlib
    reports and the full ones, with no daemon, none asked for, and a daemon's answers), and
    `plan vfio`, give each GPU the same reason."""
    build, expected = MACHINES[machine]
    s = build(tmp_path / "h")
    if captured:
        s.capture()
    model = gpuwatch.scan(s.root)
    assert {a: model.kept_for_host(a) for a in expected} == expected
    kept = {a: bool(r) for a, r in expected.items()}
    for said in await reports_every_way(capsys, monkeypatch, str(s.root)):
        for listed in (said.listed, said.status["gpus"]):
            got = {g["addr"]: (g["kept_for_host"], g["reason"]) for g in listed}
            assert got == {a: (bool(r), r) for a, r in expected.items()}, (said.where,
                                                                           said.full)
        for gpu in said.listed:
            assert (gpu["functions"][0]["hostdev_xml"] is None) is kept[gpu["addr"]]
    run, sim = simulated_cli(s, monkeypatch, capsys)
    for addr, reason in expected.items():
        code, out, _ = run("plan", "vfio", "--addr", addr, "--json", "--no-daemon")
        refused = json.loads(out)["refused"]
        if reason:
            assert code == 1 and reason in refused["reason"], out
        else:
            assert refused is None or "kept for the host" not in refused["reason"], out
    assert sim.record == []


# ------------------------------------------------------------ what the reports read


def test_the_3d_controllers_framebuffer_is_read_where_it_decides(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the iGPU the only display that is a screen whatever is read, the 3D controller's
    folder is looked into for a framebuffer: it decides whether the iGPU is kept."""
    s = optimus_dgpu_fb(tmp_path / "h")
    gpus = [(IGPU, "", "0x0300"), (DGPU, "", "0x0302")]
    groups = {IGPU: 0, DGPU: 12}
    assert bootvga.console_unread(gpus, groups) is None  # must be read
    looked = count_calls(monkeypatch, bootvga, "framebuffer_names",
                         key=lambda d: d.rsplit("/", 1)[1])
    console = read_console(str(s.root), gpus, groups)
    assert console.displays == (IGPU, DGPU) and console.framebuffers == {DGPU}
    # The screens are in two groups now: the iGPU's framebuffer decides nothing, unread.
    assert looked == [DGPU]
    s.remove_framebuffer("fb0")
    looked.clear()
    console = read_console(str(s.root), gpus, groups)
    assert console.displays == (IGPU,) and console.boot_vga == {IGPU}
    assert looked == [DGPU, IGPU]


def test_screens_in_two_groups_are_read_no_further(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Two VGA screens in two groups: nothing is read (a 3D controller's framebuffer only
    adds a screen). A VGA beside two 3D controllers of which the first carries a framebuffer:
    the second is not looked into, the screens already span two groups."""
    gpus = [(IGPU, "", "0x0300"), (DGPU, "", "0x0300"), ("0000:02:00.0", "", "0x0302")]
    groups = {IGPU: 0, DGPU: 12, "0000:02:00.0": 13}
    assert bootvga.console_unread(gpus, groups) == bootvga.HostConsole(
        (IGPU, DGPU), frozenset(), frozenset())
    s = optimus_dgpu_fb(tmp_path / "h")
    s.add_bridge("0000:00:01.1", iommu_group=2, vendor="0x8086", device="0x4609")
    s.add_function(L4, parent="0000:00:01.1", vendor="0x10de", device="0x27b8",
                   klass="0x030200", driver="nvidia", iommu_group=14)
    looked = count_calls(monkeypatch, bootvga, "framebuffer_names",
                         key=lambda d: d.rsplit("/", 1)[1])
    gpus = [(IGPU, "", "0x0300"), (DGPU, "", "0x0302"), (L4, "", "0x0302")]
    groups = {IGPU: 0, DGPU: 12, L4: 14}
    assert bootvga.console_unread(gpus, groups) is None
    console = read_console(str(s.root), gpus, groups)
    assert looked == [DGPU] and console.framebuffers == {DGPU}
    assert [g.addr for g in gpuwatch.scan(s.root).probe("detect-vfio").gpus] == [
        IGPU, DGPU, L4]


# ------------------------------------------------------------ the watcher keeps it current


async def test_the_watcher_follows_a_framebuffer_on_the_3d_controller(tmp_path: Path) -> None:
    """nvidia-drm's fbdev emulation registers fb0 on the 3D controller: the host has two
    screens, the iGPU may go; it unregisters it: the iGPU is the only screen again. The
    watcher's model says so from the ``graphics`` uevents, as a fresh scan does."""
    s = optimus(tmp_path / "h")
    async with watching(s) as (w, source, _got):
        assert w.model.kept_for_host(IGPU) == BOOT_REASON
        devpath = s.add_framebuffer("fb0", DGPU, fb_name="nvidia-drmdrmfb")
        source.push(s.uevent_props("add", devpath))
        with anyio.fail_after(10):
            while w.model.kept_for_host(IGPU):
                await anyio.sleep(0.005)
        assert gpuwatch.scan(s.root).kept_for_host(IGPU) == ""
        s.remove_framebuffer("fb0")
        source.push(s.uevent_props("remove", devpath))
        with anyio.fail_after(10):
            while not w.model.kept_for_host(IGPU):
                await anyio.sleep(0.005)
        assert w.model.kept_for_host(IGPU) == BOOT_REASON
