"""The host's only console on a display with no ``boot_vga`` file is kept for the host too.

Only VGA-class functions (0x0300) have ``boot_vga``. A guest whose only display is QEMU's
bochs-display or virtio-gpu-pci (class 0x0380), or a host whose console moved from the
firmware's framebuffer to a 3D controller's driver, shows the console as a framebuffer device
(``graphics/fbN``) beneath the display function instead: with it as the only display
function, `list` must not offer it and `mode vfio` must refuse it. A headless GPU with no
framebuffer stays a candidate, and the ``boot_vga`` rule is as it was. Trees laid out as
Linux lays them out, and as capture tools copy them.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from cli_helpers import reports_every_way, simulated_cli
from watch_helpers import watching

import gpuwatch
from gpuwatch.core.hostkeep import kept_for_host_reason
from gpuwatch.core.observations import FramebufferGone, FramebufferSeen
from gpuwatch.core.results import PciFunction
from gpuwatch.core.uevent import UEvent
from gpuwatch.hostfs.scan import HostPaths, observe, read_console
from gpuwatch.sources.kernel import SUBSYSTEMS
from gpuwatch.testing import SysRoot
from gpuwatch.testing.machines import (
    BOCHS_DISPLAY,
    H100_PCIE,
    VIRTIO_GPU,
    bochs_display_viommu_guest,
    headless_compute_host,
    hybrid_laptop_host,
    igpu_sriov_host,
    virtio_gpu_viommu_guest,
)

pytestmark = pytest.mark.timeout(120)

FB_REASON = "carries the host's framebuffer console"
IGPU, DGPU = "0000:00:02.0", "0000:01:00.0"


def laptop_with_0380_dgpu(root: Path) -> SysRoot:
    """A VGA iGPU with boot_vga 1 and i915's fb0, beside a 0x0380 dGPU."""
    return hybrid_laptop_host(root, dgpu_class="0x038000", fbdev=True)


#: fixture, {GPU: kept}, the GPU whose refusal `plan vfio` shows (None: none refused).
MACHINES: dict[str, tuple[Callable[[Path], SysRoot], dict[str, bool], str | None]] = {
    "bochs-display": (bochs_display_viommu_guest, {BOCHS_DISPLAY: True}, BOCHS_DISPLAY),
    "virtio-gpu": (virtio_gpu_viommu_guest, {VIRTIO_GPU: True}, VIRTIO_GPU),
    "headless-0302": (headless_compute_host, {H100_PCIE: False}, None),
    "igpu+0380": (laptop_with_0380_dgpu, {IGPU: False, DGPU: False}, None),
}


def fn(addr: str, klass: str = "0x038000", physfn: str = "") -> PciFunction:
    return PciFunction(addr=addr, vendor_id="0x1234", device_id="0x1111", class_=klass,
                       class_label="", driver="bochs-drm", iommu_group=1, physfn=physfn)


# ------------------------------------------------------------ the rule, pure


def test_rule_keeps_the_only_display_with_a_framebuffer() -> None:
    gpu = fn(BOCHS_DISPLAY)
    reason = kept_for_host_reason([gpu], console_drivers=(), boot_vga=(),
                                  host_displays=[gpu.addr], framebuffers={gpu.addr})
    assert reason == (f"{gpu.addr} carries the host's framebuffer console (a graphics fbN "
                      "device) and is its only display function: passing it through leaves "
                      "the host without a console")
    # Not the only display; no framebuffer; a framebuffer of another function.
    assert kept_for_host_reason([gpu], console_drivers=(), boot_vga=(),
                                host_displays=[gpu.addr, "0000:00:03.0"],
                                framebuffers={gpu.addr}) == ""
    assert kept_for_host_reason([gpu], console_drivers=(), boot_vga=(),
                                host_displays=[gpu.addr]) == ""
    assert kept_for_host_reason([gpu], console_drivers=(), boot_vga=(),
                                host_displays=[gpu.addr], framebuffers={"0000:00:03.0"}) == ""
    # A member that is no display function (an audio function's fb: none such) keeps nothing.
    audio = fn("0000:00:02.1", klass="0x040300")
    assert kept_for_host_reason([audio], console_drivers=(), boot_vga=(),
                                host_displays=[], framebuffers={audio.addr}) == ""
    # boot_vga 1 and a framebuffer: the boot_vga reason, as before.
    both = kept_for_host_reason([gpu], console_drivers=(), boot_vga={gpu.addr},
                                host_displays=[gpu.addr], framebuffers={gpu.addr})
    assert "boot_vga 1" in both and FB_REASON not in both


# ------------------------------------------------------------ scan, reports, switch


@pytest.mark.parametrize("captured", [False, True])
@pytest.mark.parametrize("machine", sorted(MACHINES))
async def test_the_only_framebuffer_display_is_kept_everywhere(
        tmp_path: Path, machine: str, captured: bool, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The model, `list --json`, `status --json` and `list` with and without a daemon (the
    stdlib reports and the full ones), and `plan vfio`, all answer alike on a linked tree
    and on its captured copy."""
    build, expected, refused = MACHINES[machine]
    s = build(tmp_path / "h")
    if captured:
        s.capture()
    model = gpuwatch.scan(s.root)
    for addr, kept in expected.items():
        reason = model.kept_for_host(addr)
        assert bool(reason) is kept, (addr, reason)
        assert (FB_REASON in reason) is kept
    root = str(s.root)

    def kept_of(listed: list[dict[str, object]]) -> dict[object, object]:
        return {g["addr"]: g["kept_for_host"] for g in listed}

    for said in await reports_every_way(capsys, monkeypatch, root, text=True):
        where, full, text = said.where, said.full, said.text
        assert text is not None
        assert kept_of(said.listed) == expected, (where, full)
        for gpu in said.listed:
            assert (FB_REASON in gpu["reason"]) is gpu["kept_for_host"]
            xml = gpu["functions"][0]["hostdev_xml"]
            assert (xml is None) is gpu["kept_for_host"], (where, full)
        assert kept_of(said.status["gpus"]) == expected, (where, full)
        head = text.partition("<!--")[0]
        for addr, kept in expected.items():
            bus = f"bus='0x{addr[5:7]}' slot='0x{addr[8:10]}'"
            assert (bus in text) is not kept, (where, full, text)
            assert (addr in head and "kept for the host" in head) is kept
    run, sim = simulated_cli(s, monkeypatch, capsys)
    for addr in expected:
        code, out, err = run("plan", "vfio", "--addr", addr, "--json", "--no-daemon")
        plan = json.loads(out)
        if addr == refused:
            assert code == 1 and "kept for the host" in plan["refused"]["reason"], out
            assert FB_REASON in plan["refused"]["reason"]
            code, out, err = run("mode", "vfio", "--addr", addr, "--no-daemon")
            assert code == 1 and FB_REASON in err and err.count("\n") == 1
        else:
            assert plan["refused"] is None or "kept for the host" not in plan["refused"][
                "reason"], out
    assert sim.record == []


@pytest.mark.parametrize("layout", ["no sys/devices", "no bus listing"])
@pytest.mark.parametrize(("build", "addr"), [(bochs_display_viommu_guest, BOCHS_DISPLAY),
                                             (virtio_gpu_viommu_guest, VIRTIO_GPU)])
def test_copies_without_half_the_tree_answer_the_same(
        tmp_path: Path, build: Callable[[Path], SysRoot], addr: str, layout: str) -> None:
    """A capture that copied the functions into the bus listing but left out
    ``sys/devices``, and one without the listing (the scan walks ``sys/devices``): the model
    and the daemon-side reader still find the console beneath the display."""
    s = build(tmp_path / "h")
    if layout == "no sys/devices":
        s.capture()
        shutil.rmtree(s.root / "sys/devices")
    else:
        shutil.rmtree(s.root / "sys/bus/pci/devices")
        os.mkdir(s.root / "sys/bus/pci/devices")
    assert FB_REASON in gpuwatch.scan(s.root).kept_for_host(addr)
    assert read_console(str(s.root), [(addr, "", "0x0380")]).framebuffers == {addr}


def test_the_boot_vga_rule_is_as_it_was(tmp_path: Path) -> None:
    """The iGPU (VGA, boot_vga 1, i915's fb0) beside a 0x0380 dGPU: neither is kept; once
    the dGPU is gone the iGPU is kept for its boot_vga, named as before."""
    s = laptop_with_0380_dgpu(tmp_path / "h")
    s.remove_function(DGPU)
    reason = gpuwatch.scan(s.root).kept_for_host(IGPU)
    assert reason == (f"{IGPU} is the host's boot display (boot_vga 1) and its only display "
                      "function: passing it through leaves the host without a console")


def test_a_framebuffer_beside_no_function_keeps_nothing(tmp_path: Path) -> None:
    """The firmware's framebuffer on a platform device (efifb before Linux 6.9) names no PCI
    function, and a VF's ``physfn`` link never lends it the PF's framebuffer."""
    s = headless_compute_host(tmp_path / "h")
    s.add_framebuffer("fb0", None, fb_name="EFI VGA")
    model = gpuwatch.scan(s.root)
    assert model.kept_for_host(H100_PCIE) == ""


# ------------------------------------------------------------ the watcher keeps it current


def test_the_kernel_source_follows_graphics_uevents() -> None:
    assert "graphics" in SUBSYSTEMS


@pytest.mark.parametrize(("build", "addr", "under"), [
    (bochs_display_viommu_guest, BOCHS_DISPLAY, ""),
    (virtio_gpu_viommu_guest, VIRTIO_GPU, "virtio0"),
])
def test_a_graphics_uevent_reads_the_framebuffer_and_its_function(
        tmp_path: Path, build: Callable[[Path], SysRoot], addr: str, under: str) -> None:
    s = build(tmp_path / "h")
    paths = HostPaths(s.root)
    props = s.uevent_props("add", s.devpath(addr) + (f"/{under}" if under else "")
                           + "/graphics/fb0")
    event = UEvent(props["ACTION"], props["DEVPATH"], props["SUBSYSTEM"], props)
    assert FramebufferSeen("fb0", addr) in observe(paths, gpuwatch.scan(s.root).tables, event)
    s.remove_framebuffer("fb0")
    assert FramebufferGone("fb0") in observe(paths, gpuwatch.scan(s.root).tables,
                                             event._replace(action="remove"))
    # fbcon, the console's own device in the class, is no framebuffer.
    fbcon = UEvent("change", "/devices/virtual/graphics/fbcon", "graphics", {})
    assert observe(paths, gpuwatch.scan(s.root).tables, fbcon) == []


@pytest.mark.parametrize("where", ["virtual", "platform", "behind a USB controller"])
def test_a_framebuffer_no_scan_counts_is_not_counted_from_its_uevent(
        tmp_path: Path, where: str) -> None:
    """A framebuffer's uevent is attributed by the scan's own rule: one beneath no PCI
    function (a virtual one, the firmware's on a platform device) or further below the
    display than a scan looks (a USB display adapter on a controller in the display's
    folder) leaves the model as a fresh scan of the same tree builds it: not the display's
    console."""
    s = bochs_display_viommu_guest(tmp_path / "h")
    s.remove_framebuffer("fb0")
    model = gpuwatch.scan(s.root)
    if where == "virtual":
        devpath = s.add_framebuffer("fb1", None)
    else:
        devpath = ("/devices/platform/simple-framebuffer.0/graphics/fb1" if where == "platform"
                   else s.devpath(BOCHS_DISPLAY) + "/usb1/1-1/1-1:1.0/graphics/fb1")
        os.makedirs(s.root / "sys" / devpath.lstrip("/"))
        (s.root / "sys" / devpath.lstrip("/") / "dev").write_text("29:1\n")
    event = UEvent("add", devpath, "graphics", {"DEVNAME": "fb1"})
    model.state.apply(observe(HostPaths(s.root), model.tables, event))
    fresh = gpuwatch.scan(s.root)
    assert model.state.framebuffers == fresh.state.framebuffers == {}
    assert model.kept_for_host(BOCHS_DISPLAY) == fresh.kept_for_host(BOCHS_DISPLAY) == ""


async def until_kept(w: object, addr: str, kept: bool) -> str:
    with anyio.fail_after(10):
        while bool(reason := w.model.kept_for_host(addr)) is not kept:  # type: ignore[attr-defined]
            await anyio.sleep(0.005)
    return reason


async def test_the_watcher_follows_the_console_coming_and_going(tmp_path: Path) -> None:
    """bochs-drm's fbdev emulation registers fb0 after the guest booted (a deferred setup)
    and unregisters it again: the watcher's model keeps the display for the host exactly
    while the framebuffer is there, and a resync agrees."""
    s = bochs_display_viommu_guest(tmp_path / "h")
    s.remove_framebuffer("fb0")
    async with watching(s) as (w, source, _got):
        assert w.model.kept_for_host(BOCHS_DISPLAY) == ""
        devpath = s.add_framebuffer("fb0", BOCHS_DISPLAY, fb_name="bochs-drmdrmfb")
        source.push(s.uevent_props("add", devpath))
        assert FB_REASON in await until_kept(w, BOCHS_DISPLAY, True)
        assert w.model.kept_for_host(BOCHS_DISPLAY) == gpuwatch.scan(s.root).kept_for_host(
            BOCHS_DISPLAY)
        s.remove_framebuffer("fb0")
        source.push(s.uevent_props("remove", devpath))
        assert await until_kept(w, BOCHS_DISPLAY, False) == ""
        s.add_framebuffer("fb0", BOCHS_DISPLAY, fb_name="bochs-drmdrmfb")
        await w.resync("reconcile")  # no uevent: the scan finds it
        assert FB_REASON in w.model.kept_for_host(BOCHS_DISPLAY)


@pytest.mark.parametrize("under", ["an SR-IOV VF", "a non-display function"])
async def test_a_framebuffer_beneath_no_own_display_is_not_in_the_watchers_model(
        tmp_path: Path, under: str) -> None:
    """A scan records framebuffers beneath the own display functions only (no VF, no
    function of another class). A ``graphics`` uevent for one beneath a VF (its driver's
    fbdev emulation) or beneath a non-display function leaves the watcher's model as a fresh
    scan of the same tree builds it (it was kept: no answer changed, the model differed)."""
    s = igpu_sriov_host(tmp_path / "h")
    other = "0000:00:02.1" if under == "an SR-IOV VF" else "0000:05:00.0"
    if under == "a non-display function":
        s.add_function(other, vendor="0x8086", device="0x1533", klass="0x020000")
    async with watching(s) as (w, source, _got):
        assert w.model.state.framebuffers == {}
        source.push(s.uevent_props("add", s.add_framebuffer("fb1", other)))
        # Then one beneath the own display: once it is in, the first was applied too.
        source.push(s.uevent_props("add", s.add_framebuffer("fb0", IGPU)))
        with anyio.fail_after(10):
            while "fb0" not in w.model.state.framebuffers:
                await anyio.sleep(0.005)
        fresh = gpuwatch.scan(s.root)
        assert fresh.state.framebuffers == {"fb0": IGPU}
        assert w.model.state.framebuffers == fresh.state.framebuffers
