"""More kinds of real host (HGX with NVSwitches, Optimus laptop, Intel Flex with SR-IOV VFs,
AMD APU beside a dGPU, VFIO no-IOMMU, VM guests, AMD MxGPU, hosts without a GPU), each
answering the same as captured by the tools that copy sysfs: links followed into folders
(``cp -rL``, ``tar -h``), GNU tar's NUL padding of every attribute, and links a copier
dropped to stay out of sysfs's cycles."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_helpers import run_main as cli
from cli_helpers import simulated_cli

import gpuwatch
from gpuwatch.core.observations import PciGone
from gpuwatch.hostfs import scan as scan_mod
from gpuwatch.hostfs.bootvga import listed_console
from gpuwatch.hostfs.noiommu import read_iommu_groups
from gpuwatch.jsonout import jsonable
from gpuwatch.testing import SysRoot, example_gpu_host
from gpuwatch.testing.machines import (
    amd_apu_dgpu_host,
    arc_desktop_host,
    bmc_server_host,
    bochs_guest_with_l4,
    headless_host,
    hgx_h100_host,
    hybrid_laptop_host,
    hyperv_gpu_guest,
    igpu_sriov_host,
    instinct_host,
    intel_flex_sriov_host,
    jetson_orin_host,
    mi300x_cpx_host,
    mxgpu_host,
    turing_desktop_host,
    vfio_noiommu_host,
    virtio_gpu_guest,
    vmd_host,
)
from gpuwatch.testing.modern import grace_hopper_host, sriov_gpu_host

PROBES = ("detect-vfio", "detect-gpu", "detect-amd-gpu", "amd-gfx-version", "amd-gfx-target",
          "detect-host-devices")

MACHINES: dict[str, Callable[[Path], SysRoot]] = {
    "example": example_gpu_host,
    "bmc": bmc_server_host,
    "turing": turing_desktop_host,
    "instinct": instinct_host,
    "grace-hopper": grace_hopper_host,
    "sriov": lambda r: sriov_gpu_host(r, vfs=2),
    "hgx": lambda r: hgx_h100_host(r, gpus=2),
    "hgx-noacs": lambda r: hgx_h100_host(r, gpus=2, acs=False),
    "laptop": hybrid_laptop_host,
    "flex": lambda r: intel_flex_sriov_host(r, vfs=2),
    "arc": arc_desktop_host,
    "arc-xe-no-acs": lambda r: arc_desktop_host(r, driver="xe", acs=False),
    "igpu-sriov": igpu_sriov_host,
    "apu": amd_apu_dgpu_host,
    "noiommu": vfio_noiommu_host,
    "virtio-guest": virtio_gpu_guest,
    "bochs-guest": bochs_guest_with_l4,
    "mxgpu": lambda r: mxgpu_host(r, vfs=2),
    "mi300x": lambda r: mi300x_cpx_host(r, partitions=2),
    "headless": headless_host,
    "headless-pt": lambda r: headless_host(r, iommu="pt"),
    "jetson": jetson_orin_host,
    "hyperv": hyperv_gpu_guest,
    "vmd": vmd_host,
}


def answers(root: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    """Every probe, and per GPU the per-address probes and the plan, and `status` and
    `list` as JSON: what a captured tree must answer as its host did."""
    model = gpuwatch.scan(root)
    got: dict[str, object] = {a: jsonable(model.probe(a)) for a in PROBES}
    for gpu in model.probe("detect-vfio").gpus:
        for action in ("display-driver", "current-mode", "vfio-backend"):
            got[f"{action} {gpu.addr}"] = jsonable(model.probe(action, addr=gpu.addr))
        for mode in ("vfio", "nvidia"):
            got[f"in {mode} {gpu.addr}"] = model.probe("group-in-mode", addr=gpu.addr, mode=mode)
            got[f"plan {mode} {gpu.addr}"] = cli(capsys, "probe", "plan", "--mode", mode,
                                                 "--addr", gpu.addr, "--root", str(root))
    for command in ("status", "list"):
        code, out, err = cli(capsys, command, "--json", "--no-daemon", "--root", str(root))
        assert (code, err) == (0, ""), command
        got[command] = json.loads(out)
    return got


@pytest.mark.parametrize("kind", sorted(MACHINES))
def test_tar_capture_answers_like_the_host(tmp_path: Path, kind: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """``tar -chf`` of a host's sysfs: links followed into folders, and every attribute
    padded with NULs to the 4096 bytes sysfs reports as its size."""
    live = MACHINES[kind](tmp_path / "live")
    captured = MACHINES[kind](tmp_path / "captured")
    captured.capture()
    captured.pad_like_tar()
    vendor = captured.root / "sys/bus/pci/devices" / live.functions[-1] / "vendor"
    data = vendor.read_bytes()
    assert len(data) == 4096 and data.endswith(b"\0\0") and data.rstrip(b"\0").endswith(b"\n")
    assert answers(captured.root, capsys) == answers(live.root, capsys)


# ------------------------------------------------------------ the kinds themselves


def _nvidia_information(s: SysRoot, addr: str, minor: int) -> None:
    """``proc/driver/nvidia/gpus/<addr>/information``, as the driver writes it per GPU."""
    d = s.root / "proc/driver/nvidia/gpus" / addr
    d.mkdir(parents=True)
    (d / "information").write_text(f"Model: \t\t NVIDIA H100 80GB HBM3\nDevice Minor: \t {minor}\n")


def test_hgx_nvswitches_are_no_gpus_and_keep_the_module(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """NVSwitches (class 0x0680, on nvidia-nvswitch, a PCI driver of nvidia.ko) are no GPUs;
    switching the last GPU on nvidia to vfio only unbinds it: unloading nvidia would take
    the NVSwitches from their driver too."""
    s = hgx_h100_host(tmp_path / "h", gpus=1)
    _nvidia_information(s, "0000:19:00.0", 0)
    gpus = probe_gpus(s)
    assert list(gpus) == ["0000:03:00.0", "0000:19:00.0"]  # the BMC's VGA and the H100
    assert gpus["0000:19:00.0"]["class_label"] == "3D controller"
    assert probe_value(s, "detect-gpu") is True
    code, out, err = cli(capsys, "plan", "vfio", "--addr", "0000:19:00.0", "--json",
                         "--no-daemon", "--root", str(s.root))
    assert (code, err) == (0, "")
    steps = json.loads(out)["steps"]
    argvs = [st["argv"] for st in steps if st["kind"] == "command"]
    assert not any(a[:2] == ["modprobe", "-r"] for a in argvs), argvs
    writes = [(st["path"], st["value"]) for st in steps if st["kind"] == "write"]
    assert writes[0] == ("/sys/bus/pci/drivers/nvidia/unbind", "0000:19:00.0")
    code, out, _ = cli(capsys, "list", "--json", "--no-daemon", "--root", str(s.root))
    listed = {g["addr"]: g for g in json.loads(out)}
    assert listed["0000:03:00.0"]["kept_for_host"] is True
    assert listed["0000:19:00.0"]["kept_for_host"] is False


def probe_value(s: SysRoot, action: str, **kw: object) -> object:
    return jsonable(gpuwatch.scan(s.root).probe(action, **kw))  # type: ignore[arg-type]


def probe_gpus(s: SysRoot) -> dict[str, dict[str, object]]:
    return {g["addr"]: g for g in probe_value(s, "detect-vfio")["gpus"]}  # type: ignore[index]


def test_optimus_laptop(tmp_path: Path) -> None:
    """iGPU on the panel, dGPU a 3D controller with no boot_vga and no audio: two render
    nodes, the first GPU vendor's wins. The iGPU's group is the host's: the 3D controller
    drives no screen (no outputs, no framebuffer), so the iGPU is the host's only one."""
    s = hybrid_laptop_host(tmp_path / "h")
    gpus = probe_gpus(s)
    assert [(a, g["class"], g["driver"]) for a, g in gpus.items()] == [
        ("0000:00:02.0", "0x0300", "i915"), ("0000:01:00.0", "0x0302", "nvidia")]
    assert not (s.device_dir("0000:01:00.0") / "boot_vga").exists()
    hd = probe_value(s, "detect-host-devices")
    assert hd["devices"] == ["/dev/dri/renderD128", "/dev/dri/renderD129"]  # type: ignore[index]
    assert hd["render_node"] == "/dev/dri/renderD128"  # type: ignore[index]
    assert probe_value(s, "detect-gpu") is False  # no CDI spec, no nvidia-ctk
    s.add_cdi_spec("etc")
    assert probe_value(s, "detect-gpu") is True
    model = gpuwatch.scan(s.root)
    assert model.kept_for_host("0000:00:02.0") == (
        "0000:00:02.0 is the host's boot display (boot_vga 1) and its only display function: "
        "passing it through leaves the host without a console")
    assert model.kept_for_host("0000:01:00.0") == ""
    vfio = model.probe("detect-vfio")
    assert (vfio.iommu_enabled, vfio.iommu_kind) == (True, "intel")  # on by default, no cmdline


def test_intel_flex_vfs_are_gpus_of_their_own(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    s = intel_flex_sriov_host(tmp_path / "h", vfs=2)
    gpus = probe_gpus(s)
    pf = gpus["0000:4d:00.0"]
    assert (pf["class_label"], pf["driver"], pf["sriov"]) == (
        "Display controller", "i915",
        {"totalvfs": 31, "numvfs": 2, "vfs": ["0000:4d:00.1", "0000:4d:00.2"]})
    assert [(g["physfn"], g["iommu_group"], g["driver"]) for a, g in gpus.items()
            if a in ("0000:4d:00.1", "0000:4d:00.2")] == [
        ("0000:4d:00.0", 34, "vfio-pci"), ("0000:4d:00.0", 35, "vfio-pci")]
    assert probe_value(s, "vfio-group-accessible", group=34) is True
    code, out, _ = cli(capsys, "list", "--json", "--no-daemon", "--root", str(s.root))
    listed = {g["addr"]: g for g in json.loads(out)}
    assert listed["0000:4d:00.1"]["physfn"] == "0000:4d:00.0"
    assert "2 SR-IOV virtual function(s) enabled" in listed["0000:4d:00.0"]["note"]
    code, _, err = cli(capsys, "probe", "plan", "--mode", "vfio", "--addr", "0000:4d:00.0",
                       "--root", str(s.root))
    assert code == 1 and "virtual function" in err


@pytest.mark.parametrize("driver", ["i915", "xe"])
def test_arc_behind_its_own_switch(tmp_path: Path, driver: str,
                                   capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An Arc A770 with its audio on another bus and in another IOMMU group: the GPU's group
    is the GPU alone, listed and switched alone; the audio is no card of its own. The switch
    unbinds the Arc from its driver and unloads nothing: the iGPU (the boot display, not the
    only one) stays on i915. Both are Intel's, so the render node is the first, the iGPU's."""
    s = arc_desktop_host(tmp_path / "h", driver=driver)
    gpus = probe_gpus(s)
    assert [(a, g["driver"], g["iommu_group"]) for a, g in gpus.items()] == [
        ("0000:00:02.0", "i915", 0), ("0000:03:00.0", driver, 4)]
    assert [m["addr"] for m in gpus["0000:03:00.0"]["group_members"]] == ["0000:03:00.0"]
    hd = probe_value(s, "detect-host-devices")
    assert hd["render_node"] == "/dev/dri/renderD128"  # type: ignore[index]
    code, out, _ = cli(capsys, "list", "--json", "--no-daemon", "--root", str(s.root))
    listed = {g["addr"]: g for g in json.loads(out)}
    assert [f["addr"] for f in listed["0000:03:00.0"]["functions"]] == ["0000:03:00.0"]
    assert not listed["0000:00:02.0"]["kept_for_host"]  # the Arc is a display too
    s.set_osrelease("6.8.0")
    run, sim = simulated_cli(s, monkeypatch, capsys)
    code, _, err = run("mode", "vfio", "--addr", "0000:04:00.0", "--no-daemon")
    assert code == 2 and "shares no IOMMU group" in err
    code, out, err = run("mode", "vfio", "--addr", "0000:03:00.0", "--json", "--no-daemon",
                         "--timeout", "20")
    assert code == 0, err
    assert json.loads(out)["members"] == [{"addr": "0000:03:00.0", "driver": "vfio-pci"}]
    assert sim.commands == [("modprobe", "vfio_pci")]  # no module unloaded
    assert sim.writes[0] == (f"/sys/bus/pci/drivers/{driver}/unbind", "0000:03:00.0")
    assert not [w for w in sim.writes if "0000:04:00.0" in w[1] or "00:02.0" in w[0]]
    model = gpuwatch.scan(s.root)
    assert (model.function("0000:00:02.0").driver, model.function("0000:04:00.0").driver) == (
        "i915", "snd_hda_intel")


def test_apu_beside_a_dgpu(tmp_path: Path) -> None:
    """Two amdgpu cards: the KFD node of the first one probed (the dGPU) names the target."""
    s = amd_apu_dgpu_host(tmp_path / "h")
    assert probe_value(s, "detect-amd-gpu") is True
    assert (probe_value(s, "amd-gfx-version"), probe_value(s, "amd-gfx-target")) == (
        "11.0.0", "gfx1100")
    model = gpuwatch.scan(s.root)
    assert [(g.addr, g.iommu_group) for g in model.probe("detect-vfio").gpus] == [
        ("0000:03:00.0", 5), ("0000:12:00.0", 14)]
    assert model.state.drm["renderD129"].device_addr == "0000:12:00.0"


def test_vfio_noiommu_group_has_no_group_node(tmp_path: Path) -> None:
    """No-IOMMU VFIO names its node /dev/vfio/noiommu-N: /dev/vfio/N is absent, so neither
    the group probe nor vfio-backend offers a node a VMM could open."""
    s = vfio_noiommu_host(tmp_path / "h")
    assert probe_value(s, "vfio-group-accessible", group=0) is False
    backend = probe_value(s, "vfio-backend", addr="0000:00:05.0")
    assert backend == {  # type: ignore[comparison-overlap]
        "addr": "0000:00:05.0", "driver": "vfio-pci", "on_vfio": True, "group_node": "",
        "cdev_node": "", "iommufd": False, "recommended": "none"}


def test_tar_capture_of_a_64k_page_kernel(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """sysfs reports PAGE_SIZE as every attribute's size: 65536 on the 64K-page kernels of
    Grace-Hopper nodes, so tar pads each attribute to 64 KiB."""
    live = grace_hopper_host(tmp_path / "live", bound=False)
    captured = grace_hopper_host(tmp_path / "captured", bound=False)
    captured.capture()
    captured.pad_like_tar(65536)
    assert (captured.root / "sys/bus/pci/devices/0009:01:00.0/class").stat().st_size == 65536
    assert answers(captured.root, capsys) == answers(live.root, capsys)
    fn = gpuwatch.scan(captured.root).function("0009:01:00.0")
    assert (fn.vendor_id, fn.class_, fn.driver, fn.iommu_group) == ("0x10de", "0x0302",
                                                                     "nvidia", 19)


def _absolute_links(root: Path) -> int:
    """Respell every link under ``sys/`` that leads inside the tree as an absolute one
    (``/sys/devices/…``), as some copy tools leave a tree; returns how many."""
    count = 0
    for link in sorted(p for p in (root / "sys").rglob("*") if p.is_symlink()):
        target = (link.parent / link.readlink()).resolve()
        if target.is_relative_to(root):
            link.unlink()
            link.symlink_to("/" + str(target.relative_to(root)))
            count += 1
    return count


@pytest.mark.parametrize("kind", ["example", "apu", "flex", "grace-hopper"])
def test_absolute_links_lead_inside_the_root(tmp_path: Path, kind: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A tree whose links are spelled absolute (``/sys/devices/pci0000:00/…``) is read as
    a chroot would read it: each link leads under the root, never into the sysfs of the
    host running gpuwatch (whose devices have the same addresses)."""
    live = MACHINES[kind](tmp_path / "live")
    copied = MACHINES[kind](tmp_path / "copied")
    assert _absolute_links(copied.root) > 10
    entry = copied.root / "sys/bus/pci/devices" / live.functions[-1]
    assert str(entry.readlink()).startswith("/sys/devices/")
    assert answers(copied.root, capsys) == answers(live.root, capsys)


def test_relative_links_that_climb_past_the_root_lead_inside_it(tmp_path: Path) -> None:
    """A relative link spelled with more ``..`` than it is deep (only a damaged or hostile
    tree has one) is read as in a chroot too: ``..`` stops at the root. Followed by the
    kernel, ``sys/class/drm/card1`` would lead into another tree of this host, here an
    Instinct host's AMD card; read in the tree, it leads nowhere."""
    host = example_gpu_host(tmp_path / "host")
    other = MACHINES["instinct"](tmp_path / "other")
    outside = other.root / "sys/devices/pci0000:00/0000:10:01.0/0000:11:00.0/drm/card1"
    assert gpuwatch.scan(other.root).state.drm["card1"].device_vendor == "0x1002"
    entry = host.root / "sys/class/drm/card1"
    entry.unlink()
    entry.symlink_to(os.path.relpath(outside, entry.parent))
    assert str(entry.readlink()).startswith("../../../../other/")
    assert (entry / "device/vendor").read_text().strip() == "0x1002"  # as the kernel follows it
    intact = gpuwatch.scan(host.root).state.drm["card0"]
    card0 = host.root / "sys/class/drm/card0"  # past the root and back into sys: still home
    card0_target = "../../../../sys/" + str(card0.readlink()).removeprefix("../../")
    card0.unlink()
    card0.symlink_to(card0_target)
    model = gpuwatch.scan(host.root)
    assert "card1" not in model.state.drm
    assert all(node.device_vendor != "0x1002" for node in model.state.drm.values())
    assert model.state.drm["card0"] == intact


@pytest.mark.parametrize("spelling", ["./host", "host", "../{cwd}/host", "host/../host"])
@pytest.mark.parametrize("kind", ["example", "laptop", "noiommu"])
def test_a_root_given_relative_reads_as_given_absolute(
        tmp_path: Path, kind: str, spelling: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--root ./host`` is the tree at ``$PWD/host``: every link is read in it as when the
    root is spelled absolute, in the scan and in what the reports read with the root as
    given (a daemon's answers carry no ``boot_vga``; the no-IOMMU groups). A relative root
    once made `in_root` take every link for one that leads out of the tree."""
    MACHINES[kind](tmp_path / "host")
    whole = str(tmp_path / "host")
    gpus = [(g.addr, g.physfn, g.class_) for g in gpuwatch.scan(whole).probe("detect-vfio").gpus]
    absolute = (answers(Path(whole), capsys), listed_console(whole, gpus),
                read_iommu_groups(whole))
    # The boot GPU's boot_vga, read through its bus entry.
    assert absolute[1] is not None and absolute[1].boot_vga
    monkeypatch.chdir(tmp_path)
    root = spelling.format(cwd=tmp_path.name)
    assert (answers(Path(root), capsys), listed_console(root, gpus),
            read_iommu_groups(root)) == absolute


@pytest.mark.parametrize("captured", [False, True])
# The kinds with a DRM node on a PCI function (not a virtio device, nor none at all).
@pytest.mark.parametrize("kind", ["apu", "bmc", "bochs-guest", "example", "flex", "hgx",
                                  "instinct", "laptop", "mi300x", "noiommu", "turing"])
def test_drm_nodes_take_their_devices_from_the_functions_just_scanned(
        tmp_path: Path, kind: str, captured: bool) -> None:
    """A scan gives each DRM node its device's vendor and driver from the function it has
    just read instead of reading them again: the nodes come out as a scan without them reads
    them, on the kernel's layout and on a copy with its links flattened."""
    host = MACHINES[kind](tmp_path / "h")
    if captured:
        host.capture()
    paths = scan_mod.HostPaths(host.root)
    functions = {f.addr: f for f in scan_mod.scan_functions(paths)}
    alone = scan_mod.scan_drm(paths)
    assert scan_mod.scan_drm(paths, functions) == alone
    assert any(node.device_addr in functions and node.device_vendor for node in alone)


# ------------------------------------------------------------ links a capture dropped


def _drop_links(root: Path, names: set[str]) -> int:
    """Remove every link of those names under ``sys/``: what a copier that will not follow
    a link into one of sysfs's cycles leaves (a ``driver`` folder links back to its devices,
    an IOMMU group's ``devices/`` too, a DRM node's ``device`` to its parent). Returns how
    many."""
    gone = 0
    for link in [p for p in (root / "sys").rglob("*") if p.is_symlink() and p.name in names]:
        link.unlink()
        gone += 1
    return gone


def _drop_uevents(root: Path) -> None:
    """A copier that takes a fixed list of attributes, ``uevent`` not among them."""
    for path in (root / "sys").rglob("uevent"):
        if path.is_file() and not path.is_symlink() and "module" not in path.parts:
            path.unlink()


DROPS: dict[str, Callable[[SysRoot], object]] = {
    # captured (links followed into folders), one kind of link dropped
    "driver": lambda s: (s.capture(nested=("device", "iommu_group")),
                         _drop_links(s.root, {"driver"})),
    "iommu_group": lambda s: (s.capture(nested=("device", "driver")),
                              _drop_links(s.root, {"iommu_group"})),
    "device": lambda s: (s.capture(nested=("driver", "iommu_group")),
                         _drop_links(s.root, {"device"})),
    # the kernel's layout, SR-IOV's links both ways dropped: the VFs found beside their PF
    "sriov": lambda s: _drop_links(s.root, {"physfn", *(f"virtfn{i}" for i in range(64))}),
    # the kernel's layout, all three dropped, and no uevent file copied either
    "all-no-uevent": lambda s: (_drop_links(s.root, {"driver", "iommu_group", "device"}),
                                _drop_uevents(s.root)),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("drop", sorted(DROPS))
@pytest.mark.parametrize("kind", sorted(MACHINES))
def test_dropped_links_answer_like_the_host(tmp_path: Path, kind: str, drop: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A link the copy left out is still told by the kernel's own files: a driver by the
    ``DRIVER`` of the function's ``uevent`` (or the driver folder listing it), an IOMMU
    group by the group folder listing the function, a DRM node's device by the folder the
    node lies in (or the function whose ``drm/`` lists it)."""
    live = MACHINES[kind](tmp_path / "live")
    copied = MACHINES[kind](tmp_path / "copied")
    DROPS[drop](copied)
    assert answers(copied.root, capsys) == answers(live.root, capsys)


def test_a_dropped_driver_link_is_told_by_the_uevent(tmp_path: Path) -> None:
    s = example_gpu_host(tmp_path / "h")
    assert _drop_links(s.root, {"driver"}) == 6  # every bound function's
    fns = {f.addr: f for f in gpuwatch.scan(s.root).functions()}
    assert (fns["0000:01:00.0"].driver, fns["0000:00:02.0"].driver) == ("nvidia", "i915")
    assert fns["0000:00:00.0"].driver == ""  # its uevent names none: unbound
    assert probe_value(s, "detect-gpu") is True
    # No uevent either: the driver folder that lists the function.
    _drop_uevents(s.root)
    assert gpuwatch.scan(s.root).function("0000:01:00.1").driver == "snd_hda_intel"
    assert gpuwatch.scan(s.root).function("0000:00:00.0").driver == ""


def test_a_dropped_group_link_is_told_by_the_group_listing(tmp_path: Path) -> None:
    s = turing_desktop_host(tmp_path / "h")
    _drop_links(s.root, {"iommu_group"})
    gpu = probe_gpus(s)["0000:01:00.0"]
    assert gpu["iommu_group"] == 1
    assert [m["addr"] for m in gpu["group_members"]] == [  # type: ignore[union-attr]
        "0000:00:01.0", "0000:01:00.0", "0000:01:00.1", "0000:01:00.2", "0000:01:00.3"]


def test_a_dropped_drm_device_link_is_told_by_where_the_node_lies(tmp_path: Path) -> None:
    s = amd_apu_dgpu_host(tmp_path / "h")
    _drop_links(s.root / "sys/devices", {"device"})
    drm = gpuwatch.scan(s.root).state.drm
    assert (drm["renderD129"].device_addr, drm["renderD129"].device_driver) == (
        "0000:12:00.0", "amdgpu")
    assert probe_value(s, "detect-amd-gpu") is True
    # The node copied as a folder: the function whose drm/ folder lists it.
    s.flatten_link("sys/class/drm/card1")
    assert not (s.root / "sys/class/drm/card1/device").exists()
    assert gpuwatch.scan(s.root).state.drm["card1"].device_addr == "0000:12:00.0"


def test_a_node_copied_without_its_device_beside_a_bus_listing_of_no_function(
        tmp_path: Path) -> None:
    """A capture that took no bus link but left something else in ``sys/bus/pci/devices``
    (not an address: ignored, so the functions are the walk's). A node copied as a folder
    without its ``device`` is the walked function's whose ``drm/`` lists it; it was looked
    for among the stray entries alone and read as having no device."""
    s = amd_apu_dgpu_host(tmp_path / "h")
    s.capture()
    shutil.rmtree(s.root / "sys/class/drm/card1/device")
    bus = s.root / "sys/bus/pci/devices"
    for entry in bus.iterdir():
        shutil.rmtree(entry)
    (bus / ".keep").write_text("")
    model = gpuwatch.scan(s.root)
    assert "0000:12:00.0" in [f.addr for f in model.functions()]
    assert model.state.drm["card1"].device_addr == "0000:12:00.0"
    assert probe_value(s, "detect-amd-gpu") is True


def test_a_dropped_drm_device_link_in_the_flat_layout(tmp_path: Path) -> None:
    """In the flat layout a node lies in the ``drm/`` of its function's folder in
    ``sys/bus/pci/devices``, and its class link says so (``/bus/pci/devices/<addr>/drm/card0``):
    that function is its device, as ``/devices/…/<addr>/drm/card0`` names it in the other.
    The node read as having none lost the render-node choice to a virtual node and hid the
    AMD card from detect-amd-gpu."""
    s = SysRoot(tmp_path / "h", layout="flat")
    s.add_function("0000:03:00.0", vendor="0x1002", device="0x744c", driver="amdgpu",
                   iommu_group=5)
    s.add_drm("renderD128", None)
    s.add_drm("card0", "0000:03:00.0")
    s.add_drm("renderD129", "0000:03:00.0")
    assert _drop_links(s.root, {"device"}) == 2
    drm = gpuwatch.scan(s.root).state.drm
    assert (drm["card0"].device_addr, drm["card0"].device_driver) == ("0000:03:00.0", "amdgpu")
    assert probe_value(s, "detect-amd-gpu") is True
    assert probe_value(s, "detect-host-devices")["render_node"] == "/dev/dri/renderD129"  # type: ignore[index]


def test_a_virtual_drm_node_has_no_device(tmp_path: Path) -> None:
    """vgem/vkms-like nodes in ``devices/virtual/drm``: no parent device to name."""
    s = headless_host(tmp_path / "h")
    s.add_drm("card0", None)
    s.add_drm("renderD128", None)
    node = gpuwatch.scan(s.root).state.drm["renderD128"]
    assert (node.device_addr, node.device_vendor, node.device_driver) == ("", "", "")
    assert probe_value(s, "detect-host-devices")["render_node"] == "/dev/dri/renderD128"  # type: ignore[index]


# ------------------------------------------------------------ VM guests, MxGPU, no GPU


def test_virtio_gpu_guest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """virtio-gpu's DRM nodes hang under ``virtio0``, not the PCI function: its node is no
    known GPU vendor's, yet the only one, so it is the render node; the function is a GPU
    on virtio-pci with no IOMMU group, the host's console, never offered."""
    s = virtio_gpu_guest(tmp_path / "h")
    assert not (s.root / "sys/kernel/iommu_groups").exists()
    gpus = probe_gpus(s)
    assert list(gpus) == ["0000:00:01.0"]
    assert (gpus["0000:00:01.0"]["driver"], gpus["0000:00:01.0"]["iommu_group"]) == (
        "virtio-pci", -1)
    node = gpuwatch.scan(s.root).state.drm["card0"]
    assert (node.device_addr, node.device_vendor, node.device_driver) == (
        "", "0x1af4", "virtio_gpu")
    assert probe_value(s, "detect-host-devices") == {
        "gpu": False, "amd_gpu": False, "amd_gfx_version": "", "amd_gfx_target": "",
        "devices": ["/dev/dri/renderD128", "/dev/vhost-net"],
        "render_node": "/dev/dri/renderD128"}
    vfio = probe_value(s, "detect-vfio")
    assert (vfio["iommu_enabled"], vfio["iommu_kind"]) == (False, "")  # type: ignore[index]
    code, out, err = cli(capsys, "list", "--json", "--no-daemon", "--root", str(s.root))
    assert (code, err) == (0, "") and json.loads(out) == []
    code, out, _ = cli(capsys, "status", "--json", "--no-daemon", "--root", str(s.root))
    status = json.loads(out)
    assert status["iommu"]["enabled"] is False
    assert status["gpus"][0]["kept_for_host"] is True


def test_bochs_guest_with_a_passed_through_l4(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Inside the guest the L4 is a container GPU (detect-gpu true, its render node chosen)
    but no passthrough candidate: no vIOMMU, no group."""
    s = bochs_guest_with_l4(tmp_path / "h")
    assert probe_value(s, "detect-gpu") is True
    hd = probe_value(s, "detect-host-devices")
    assert hd["render_node"] == "/dev/dri/renderD128"  # type: ignore[index]
    assert [(a, g["driver"], g["iommu_group"]) for a, g in probe_gpus(s).items()] == [
        ("0000:00:02.0", "bochs-drm", -1), ("0000:01:00.0", "nvidia", -1)]
    assert probe_value(s, "group-in-mode", addr="0000:01:00.0", mode="nvidia") is True
    assert probe_value(s, "vfio-backend", addr="0000:01:00.0")["recommended"] == "none"  # type: ignore[index]
    code, out, _ = cli(capsys, "list", "--json", "--no-daemon", "--root", str(s.root))
    assert code == 0 and json.loads(out) == []
    code, out, _ = cli(capsys, "status", "--json", "--no-daemon", "--root", str(s.root))
    status = json.loads(out)
    assert status["iommu"]["enabled"] is False and status["nvidia_usable"] is True
    # The L4 is a 3D controller with no framebuffer: no screen, so the boot VGA is the
    # guest's only one, kept (no group: the rule is the same with the IOMMU off).
    assert [g["kept_for_host"] for g in status["gpus"]] == [True, False]


def test_mxgpu_host(tmp_path: Path) -> None:
    """gim drives the PF (no amdgpu: no DRM, no KFD, detect-amd-gpu false); the PF and its
    VFs are Processing accelerators (0x1200), no display class, so no GPUs of the contract;
    each VF is still a PCI function a VMM can open through its group."""
    s = mxgpu_host(tmp_path / "h", vfs=2)
    model = gpuwatch.scan(s.root)
    pf = model.function("0000:05:00.0")
    assert (pf.driver, pf.class_, pf.sriov is not None and pf.sriov.vfs) == (
        "gim", "0x1200", ("0000:05:00.2", "0000:05:00.3"))
    vf = model.function("0000:05:00.2")
    assert (vf.physfn, vf.device_id, vf.driver, vf.iommu_group) == (
        "0000:05:00.0", "0x74b5", "vfio-pci", 11)
    assert probe_value(s, "detect-vfio")["gpus"] == []  # type: ignore[index]
    assert (probe_value(s, "detect-amd-gpu"), probe_value(s, "amd-gfx-version")) == (False, "")
    backend = probe_value(s, "vfio-backend", addr="0000:05:00.3")
    assert (backend["group_node"], backend["recommended"]) == ("/dev/vfio/12", "group")  # type: ignore[index]
    assert probe_value(s, "vfio-group-accessible", group=12) is True


@pytest.mark.parametrize("iommu", ["off", "empty", "pt"])
def test_host_without_a_gpu(tmp_path: Path, iommu: str,
                            capsys: pytest.CaptureFixture[str]) -> None:
    s = headless_host(tmp_path / "h", iommu=iommu)
    assert (s.root / "sys/kernel/iommu_groups").exists() is (iommu != "off")
    assert probe_value(s, "detect-vfio") == {
        "iommu_enabled": iommu == "pt", "iommu_kind": "intel" if iommu == "pt" else "",
        "iommufd": False, "gpus": []}
    assert probe_value(s, "detect-host-devices") == {
        "gpu": False, "amd_gpu": False, "amd_gfx_version": "", "amd_gfx_target": "",
        "devices": ["/dev/kvm"], "render_node": ""}
    for action in ("detect-gpu", "detect-amd-gpu"):
        assert probe_value(s, action) is False
    assert (probe_value(s, "amd-gfx-version"), probe_value(s, "amd-gfx-target")) == ("", "")
    code, out, err = cli(capsys, "status", "--json", "--no-daemon", "--root", str(s.root))
    assert (code, err) == (0, "")
    status = json.loads(out)
    assert (status["iommu"]["enabled"], status["gpus"]) == (iommu == "pt", [])
    code, out, err = cli(capsys, "list", "--no-daemon", "--root", str(s.root))
    assert (code, err) == (0, "") and out.startswith("no passthrough-capable GPU")
    code, _, err = cli(capsys, "probe", "display-driver", "--addr", "0000:01:00.0",
                       "--root", str(s.root))
    assert code == 1 and "no PCI function 0000:01:00.0" in err


def _bus_copy_only(s: SysRoot) -> None:
    """A copier that took each ``sys/bus/pci/devices`` entry as a folder (links followed)
    and ``sys/class`` as it is, but not ``sys/devices``: every class link dangles."""
    for name in sorted(os.listdir(s.root / "sys/bus/pci/devices")):
        s.flatten_link(f"sys/bus/pci/devices/{name}", nested=("driver", "iommu_group"))
    for name in os.listdir(s.root / "sys/devices"):
        if name.startswith("pci"):
            shutil.rmtree(s.root / "sys/devices" / name)


@pytest.mark.parametrize("kind", ["instinct", "apu", "mi300x", "virtio-guest", "example",
                                  "bochs-guest"])
def test_class_links_into_a_device_tree_not_copied(tmp_path: Path, kind: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A DRM node whose class link dangles is read in the copy of its PCI function, where
    its devpath (``…/0000:03:00.0/drm/card0``) leads."""
    live = MACHINES[kind](tmp_path / "live")
    copied = MACHINES[kind](tmp_path / "copied")
    _bus_copy_only(copied)
    card = next(p for p in (copied.root / "sys/class/drm").iterdir() if p.name[:4] == "card")
    assert card.is_symlink() and not card.exists()
    assert answers(copied.root, capsys) == answers(live.root, capsys)


def test_kfd_without_its_class_link(tmp_path: Path) -> None:
    """``sys/class/kfd/kfd`` left out of the copy: the topology where the link led."""
    s = amd_apu_dgpu_host(tmp_path / "h")
    (s.root / "sys/class/kfd/kfd").unlink()
    assert (probe_value(s, "amd-gfx-version"), probe_value(s, "amd-gfx-target")) == (
        "11.0.0", "gfx1100")


# ------------------------------------------------------------ a root filesystem's own links


@pytest.mark.parametrize("spelling", ["/run", "../run"])
def test_var_run_leads_to_the_trees_run(tmp_path: Path, spelling: str) -> None:
    """``var/run`` is a link to ``/run`` on current distributions: with the host's root at
    ``--root /host``, the CDI spec in ``/var/run/cdi`` is the one in the tree's ``run/``,
    never the ``/run`` of whoever runs gpuwatch."""
    s = example_gpu_host(tmp_path / "h")
    s.remove_cdi_spec("etc")
    shutil.rmtree(s.root / "var/run")
    (s.root / "run/cdi").mkdir(parents=True)
    (s.root / "run/cdi/nvidia.yaml").write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\n")
    os.symlink(spelling, s.root / "var/run")
    assert probe_value(s, "detect-gpu") is True
    (s.root / "run/cdi/nvidia.yaml").unlink()
    assert probe_value(s, "detect-gpu") is False


def test_lib_linked_absolute_to_usr_lib(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A merged-/usr root whose ``lib`` is spelled ``/usr/lib``: modules.alias is the tree's."""
    s = grace_hopper_host(tmp_path / "h", bound=False)
    _, before, _ = cli(capsys, "probe", "plan", "--mode", "vfio", "--addr", "0009:01:00.0",
                       "--root", str(s.root))
    assert "nvgrace_gpu_vfio_pci" in before
    (s.root / "usr").mkdir()
    os.rename(s.root / "lib", s.root / "usr/lib")
    os.symlink("/usr/lib", s.root / "lib")
    _, after, _ = cli(capsys, "probe", "plan", "--mode", "vfio", "--addr", "0009:01:00.0",
                      "--root", str(s.root))
    assert after == before


# ------------------------------------------------------------ ids in another spelling


@pytest.mark.parametrize(("vendor", "klass"), [("0x10DE\n", "0x030000\n"),
                                               ("10de\n", "030000\n"),
                                               ("0x10de\r\n", "0X030000 \n")])
def test_ids_in_another_spelling_read_as_the_kernels(tmp_path: Path, vendor: str, klass: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Hex digits a copy spelled otherwise (upper case, no ``0x``, CRLF) are the same ids: the
    card is still NVIDIA's display function, with every answer of the kernel's spelling."""
    live = example_gpu_host(tmp_path / "live")
    copied = example_gpu_host(tmp_path / "copied")
    for addr in ("0000:01:00.0", "0000:00:02.0"):
        copied.set_attr(addr, "vendor", vendor.replace("10de", "8086").replace("10DE", "8086")
                        if addr == "0000:00:02.0" else vendor)
        copied.set_attr(addr, "class", klass)
    assert answers(copied.root, capsys) == answers(live.root, capsys)
    fn = gpuwatch.scan(copied.root).function("0000:01:00.0")
    assert (fn.vendor_id, fn.class_, fn.class_label) == ("0x10de", "0x0300", "VGA controller")


def test_ids_that_are_no_hex_stay_as_written(tmp_path: Path) -> None:
    s = example_gpu_host(tmp_path / "h")
    s.set_attr("0000:01:00.0", "vendor", "0x10dg\n")
    s.set_attr("0000:01:00.1", "class", "0x0403zz\n")
    model = gpuwatch.scan(s.root)
    assert model.function("0000:01:00.0").vendor_id == "0x10dg"
    assert model.function("0000:01:00.1").class_ == "0x0403"  # its first six characters


# ------------------------------------------------------------ no bus listing: sys/devices walked


def _all_links(root: Path, *, keep: tuple[str, ...] = ()) -> int:
    """Remove every link under ``sys/`` but those under the folders ``keep`` names (root
    relative): a copier that takes no link at all. Returns how many."""
    gone = 0
    for link in [p for p in (root / "sys").rglob("*") if p.is_symlink()]:
        if not any(str(link.relative_to(root)).startswith(k + "/") for k in keep):
            link.unlink()
            gone += 1
    return gone


NO_BUS: dict[str, Callable[[SysRoot], object]] = {
    "missing": lambda s: shutil.rmtree(s.root / "sys/bus/pci/devices"),
    "empty": lambda s: [p.unlink() for p in (s.root / "sys/bus/pci/devices").iterdir()],
    # the group listings kept: without them no file says which group a function is in
    "every-link": lambda s: _all_links(s.root, keep=("sys/kernel/iommu_groups",)),
    "every-link-no-uevent": lambda s: (_all_links(s.root, keep=("sys/kernel/iommu_groups",
                                                                "sys/bus/pci/drivers")),
                                       _drop_uevents(s.root)),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", sorted(NO_BUS))
@pytest.mark.parametrize("kind", sorted(MACHINES))
def test_no_bus_listing_walks_the_device_tree(tmp_path: Path, kind: str, how: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A capture without ``sys/bus/pci/devices`` (or with it empty: every link left out)
    finds the functions by walking ``sys/devices``, and answers as its host did."""
    live = MACHINES[kind](tmp_path / "live")
    copied = MACHINES[kind](tmp_path / "copied")
    NO_BUS[how](copied)
    assert not [p for p in (copied.root / "sys/bus/pci").glob("devices/*")]
    assert answers(copied.root, capsys) == answers(live.root, capsys)


def test_vfs_without_their_links_are_found_beside_the_pf(tmp_path: Path) -> None:
    """``physfn`` and ``virtfnN`` both dropped: VF *i* is the folder beside the PF at routing
    id PF + offset + *i* · stride; the run ends at the first index with none."""
    s = sriov_gpu_host(tmp_path / "h", vfs=3)
    pf = "0000:41:00.0"
    vfs = ("0000:41:00.4", "0000:41:00.5", "0000:41:00.6")  # offset 4, stride 1
    assert _drop_links(s.root, {"physfn", "virtfn0", "virtfn1", "virtfn2"}) == 6
    model = gpuwatch.scan(s.root)
    assert model.function(pf).sriov is not None
    assert (model.function(pf).sriov.vfs, model.function(pf).sriov.numvfs) == (vfs, 3)
    assert [model.function(vf).physfn for vf in vfs] == [pf] * 3
    # A folder at VF 1's address that is no VF (another device id) ends the run there.
    s.set_attr(vfs[1], "device", "0x1234")
    assert gpuwatch.scan(s.root).function(pf).sriov.vfs == vfs[:1]  # type: ignore[union-attr]


def test_vfs_with_their_physfn_link_are_the_links_word(tmp_path: Path) -> None:
    """A PF with ``virtfnN`` links: they alone say which VFs it has. A folder beside it at
    the next VF's routing id, with a ``physfn`` link naming it but no ``virtfnN`` for it
    yet, is not added (only a PF with no ``virtfnN`` link at all is read from its VFs')."""
    s = sriov_gpu_host(tmp_path / "h", vfs=2)
    _drop_links(s.root, {"virtfn1"})
    model = gpuwatch.scan(s.root)
    assert model.function("0000:41:00.0").sriov.vfs == ("0000:41:00.4",)  # type: ignore[union-attr]
    assert model.function("0000:41:00.0").sriov.numvfs == 1  # type: ignore[union-attr]
    assert model.function("0000:41:00.5").physfn == "0000:41:00.0"


@pytest.mark.parametrize("copy", ["links", "captured", "physfn-folders"])
def test_vfs_whose_physfn_names_a_pf_without_virtfn_links_are_its_vfs(
        tmp_path: Path, copy: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A copy that dropped every ``virtfnN`` link of a PF but kept its VFs' folders with
    their ``physfn`` links: the PF showed ``numvfs`` 0 and ``vfs`` [], so ``plan`` and the
    switch rebound it (its driver's unbind takes the VFs with it) instead of refusing. The
    VFs whose ``physfn`` names it are its VFs, on the kernel's layout and on a capture's
    flattened one alike, in every answer."""
    s = sriov_gpu_host(tmp_path / "h", vfs=2)
    pf, vfs = "0000:41:00.0", ("0000:41:00.4", "0000:41:00.5")
    if copy == "captured":
        s.capture()
    elif copy == "physfn-folders":
        for vf in vfs:
            s.flatten_link(f"sys/devices/pci0000:40/0000:40:01.0/{vf}/physfn")
    assert _drop_links(s.root, {"virtfn0", "virtfn1"}) >= 2
    assert not list((s.root / "sys").rglob("virtfn*"))
    model = gpuwatch.scan(s.root)
    sriov = model.function(pf).sriov
    assert sriov is not None and (sriov.vfs, sriov.numvfs) == (vfs, 2)
    assert [model.function(vf).physfn for vf in vfs] == [pf, pf]
    assert probe_gpus(s)[pf]["sriov"] == {"totalvfs": 16, "numvfs": 2, "vfs": list(vfs)}
    # The one-scan paths of the command line (no daemon) answer the same.
    code, out, _ = cli(capsys, "probe", "detect-vfio", "--root", str(s.root))
    assert code == 0
    assert [g["sriov"] for g in json.loads(out)["result"]["gpus"] if g["addr"] == pf] == [
        {"totalvfs": 16, "numvfs": 2, "vfs": list(vfs)}]
    code, out, _ = cli(capsys, "list", "--json", "--no-daemon", "--root", str(s.root))
    assert code == 0 and [g["addr"] for g in json.loads(out)] == [pf, *vfs]
    code, _, err = cli(capsys, "probe", "plan", "--mode", "vfio", "--addr", pf,
                       "--root", str(s.root))
    assert code == 1 and f"{pf} has 2 SR-IOV virtual function(s) enabled ({vfs[0]}, {vfs[1]})" \
        in err, err


def test_a_vf_whose_physfn_names_another_pf_is_not_counted(tmp_path: Path) -> None:
    """The ``physfn`` link is the word: a folder beside the PF whose link names another
    function is no VF of this PF (nor, with a ``physfn`` link, found by routing id)."""
    s = sriov_gpu_host(tmp_path / "h", vfs=2)
    pf = "0000:41:00.0"
    _drop_links(s.root, {"virtfn0", "virtfn1"})
    for vf in ("0000:41:00.4", "0000:41:00.5"):
        link = s.device_dir(vf) / "physfn"
        link.unlink()
        link.symlink_to("../0000:40:01.0")
    sriov = gpuwatch.scan(s.root).function(pf).sriov
    assert sriov is not None and (sriov.vfs, sriov.numvfs) == ((), 0)


@pytest.mark.parametrize("copy", ["links", "captured", "absolute"])
def test_a_virtfn_link_to_a_vf_the_copy_left_out_names_no_vf(
        tmp_path: Path, copy: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A copy of an SR-IOV host that took the PF but not two of its VFs' folders: their
    ``virtfnN`` links lead nowhere. They are no VFs of the model (no such function is in
    it), but the kernel had them enabled: ``numvfs`` counts them, and the switch of the PF
    is still refused for its VFs."""
    s = sriov_gpu_host(tmp_path / "h", vfs=3)
    pf, vfs = "0000:41:00.0", ("0000:41:00.4", "0000:41:00.5", "0000:41:00.6")
    if copy == "captured":
        s.capture()
    elif copy == "absolute":
        _absolute_links(s.root)
    for vf in vfs[1:]:
        shutil.rmtree(s.root / "sys/devices/pci0000:40/0000:40:01.0" / vf)
        entry = s.root / "sys/bus/pci/devices" / vf
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    pf_dir = s.root / "sys/bus/pci/devices" / pf
    if copy != "absolute":  # (an absolute link is read as in a chroot at the root)
        assert [os.path.exists(pf_dir / f"virtfn{i}") for i in range(3)] == [True, False, False]
    model = gpuwatch.scan(s.root)
    sriov = model.function(pf).sriov
    assert sriov is not None and (sriov.vfs, sriov.numvfs) == (vfs[:1], 3)
    assert [a for a in vfs if a in {f.addr for f in model.state.functions.values()}] == [vfs[0]]
    gpus = probe_gpus(s)
    assert gpus[pf]["sriov"] == {"totalvfs": 16, "numvfs": 3, "vfs": [vfs[0]]}
    # The VF that is there goes: its link with it, the two others' stay counted.
    model.state.apply(PciGone(vfs[0]))
    sriov = model.function(pf).sriov
    assert sriov is not None and (sriov.vfs, sriov.numvfs) == ((), 2)
    # The one-scan paths of the command line (no daemon) answer the same.
    code, out, _ = cli(capsys, "probe", "detect-vfio", "--root", str(s.root))
    assert code == 0
    assert [g["sriov"] for g in json.loads(out)["result"]["gpus"] if g["addr"] == pf] == [
        {"totalvfs": 16, "numvfs": 3, "vfs": [vfs[0]]}]
    code, out, _ = cli(capsys, "list", "--json", "--no-daemon", "--root", str(s.root))
    assert [g["addr"] for g in json.loads(out)] == [pf, vfs[0]]
    code, _, err = cli(capsys, "probe", "plan", "--mode", "vfio", "--addr", pf,
                       "--root", str(s.root))
    assert code == 1 and f"{pf} has 3 SR-IOV virtual function(s) enabled ({vfs[0]})" in err


@pytest.mark.parametrize(("offset", "stride", "want"), [
    (0x80, 2, ("0000:41:10.0", "0000:41:10.2", "0000:41:10.4")),
    (0x100, 1, ("0000:42:00.0", "0000:42:00.1", "0000:42:00.2")),  # a bus of their own
    (0xFF, 8, ("0000:41:1f.7", "0000:42:00.7", "0000:42:01.7")),
])
def test_vfs_beside_the_pf_at_any_offset_and_stride(tmp_path: Path, offset: int, stride: int,
                                                    want: tuple[str, ...]) -> None:
    s = SysRoot(tmp_path / "h")
    s.add_bridge("0000:40:01.0", domain_root="pci0000:40", iommu_group=1)
    s.add_function("0000:41:00.0", parent="0000:40:01.0", driver="nvidia", iommu_group=2)
    s.enable_sriov("0000:41:00.0", 8, offset=offset, stride=stride)
    assert tuple(s.add_vfs("0000:41:00.0", 3, first_group=3)) == want
    _drop_links(s.root, {"physfn", "virtfn0", "virtfn1", "virtfn2"})
    model = gpuwatch.scan(s.root)
    assert model.function("0000:41:00.0").sriov.vfs == want  # type: ignore[union-attr]
    assert {model.function(vf).physfn for vf in want} == {"0000:41:00.0"}


def test_a_capture_that_kept_only_the_class_shows_unknown_ids(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # As a topology gatherer copies a POWER host's GPUs: the bus listing flattened into
    # folders that hold `class` and `local_cpus` and nothing else (no ids, no uevent).
    for addr in ("0004:05:00.0", "0035:04:00.0"):
        fn = tmp_path / "sys/bus/pci/devices" / addr
        fn.mkdir(parents=True)
        (fn / "class").write_text("0x030000\n")
        (fn / "local_cpus").write_text("0000,0000ffff\n")
    gpus = jsonable(gpuwatch.scan(tmp_path).probe("detect-vfio"))["gpus"]
    assert [(g["addr"], g["vendor_id"], g["device_id"], g["class_label"]) for g in gpus] == [
        ("0004:05:00.0", "", "", "VGA controller"), ("0035:04:00.0", "", "", "VGA controller")]
    code, out, _ = cli(capsys, "status", "--root", str(tmp_path), "--no-daemon")
    assert code == 0
    assert "GPU 0004:05:00.0  unknown (VGA controller)  no IOMMU group  mode: unbound" in out
    assert "  0004:05:00.0  VGA controller       unknown  driver: (none)" in out
    assert " :  " not in out and "unknown  (" not in out


# ------------------------------------------------------------ arm64 device tree, Hyper-V vPCI


def test_jetson_orin_with_a_dgpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Root buses under the SoC's platform bus, domains 0001 and 0005, an SMMU that groups
    platform devices too: the dGPU's group holds its audio and the root port (no ACS), and
    no platform device; the dGPU's render node wins over tegra-drm's, which has no ids."""
    s = jetson_orin_host(tmp_path / "h")
    assert s.devpath("0005:01:00.0") == (
        "/devices/platform/bus@0/141a0000.pcie/pci0005:00/0005:00:00.0/0005:01:00.0")
    vfio = probe_value(s, "detect-vfio")
    assert (vfio["iommu_enabled"], vfio["iommu_kind"]) == (True, "arm")  # type: ignore[index]
    gpus = probe_gpus(s)
    assert list(gpus) == ["0005:01:00.0"]
    assert [m["addr"] for m in gpus["0005:01:00.0"]["group_members"]] == [  # type: ignore[union-attr]
        "0005:00:00.0", "0005:01:00.0", "0005:01:00.1"]
    hd = probe_value(s, "detect-host-devices")
    assert (hd["gpu"], hd["render_node"]) == (True, "/dev/dri/renderD129")  # type: ignore[index]
    code, out, _ = cli(capsys, "list", "--json", "--no-daemon", "--root", str(s.root))
    listed = json.loads(out)
    assert code == 0 and [g["addr"] for g in listed if not g["kept_for_host"]] == ["0005:01:00.0"]
    assert [f["addr"] for f in listed[0]["functions"]] == ["0005:01:00.0", "0005:01:00.1"]


def test_an_smmu_inside_a_device_tree_bus_names_the_kind(tmp_path: Path) -> None:
    """A copy without ``sys/class/iommu`` (every link left out): the SMMU units are where the
    kernel registers them, under their platform device inside the SoC's bus folder
    (``platform/bus@0/12000000.iommu/iommu/smmu.0x…``), so the kind is still ``arm``."""
    s = jetson_orin_host(tmp_path / "h")
    for link in (s.root / "sys/class/iommu").iterdir():
        link.unlink()
    assert scan_mod.iommu_units_in_devices(str(s.root / "sys/devices")) == [
        "smmu.0x0000000012000000", "smmu.0x0000000008000000"]
    assert probe_value(s, "detect-vfio")["iommu_kind"] == "arm"  # type: ignore[index]
    # Deeper than the search goes, or behind a link, is no place the kernel puts one.
    deep = s.root / "sys/devices/platform/bus@0/a/b/c.iommu/iommu/smmu.0x1"
    deep.mkdir(parents=True)
    assert "smmu.0x1" not in scan_mod.iommu_units_in_devices(str(s.root / "sys/devices"))


def test_hyperv_vpci_guest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """vPCI root buses inside VMBus channel folders, domains from their GUIDs: the A100 is a
    container GPU with no IOMMU group (no vIOMMU), so no passthrough candidate; hyperv_drm's
    node has a VMBus device, no PCI function."""
    s = hyperv_gpu_guest(tmp_path / "h")
    gpus = probe_gpus(s)
    assert [(a, g["driver"], g["iommu_group"]) for a, g in gpus.items()] == [
        ("0001:00:00.0", "nvidia", -1)]
    node = gpuwatch.scan(s.root).state.drm["card0"]
    assert (node.device_addr, node.device_vendor, node.device_driver) == (
        "", "0x1414", "hyperv_drm")
    assert probe_value(s, "detect-gpu") is True
    assert probe_value(s, "detect-host-devices")["render_node"] == "/dev/dri/renderD128"  # type: ignore[index]
    code, out, _ = cli(capsys, "list", "--json", "--no-daemon", "--root", str(s.root))
    assert code == 0 and json.loads(out) == []
    # With no bus listing, the walk finds both functions inside their VMBus channels.
    shutil.rmtree(s.root / "sys/bus/pci/devices")
    assert [a for a, _ in scan_mod.walk_functions(str(s.root / "sys"))] == [
        "0001:00:00.0", "c3bc:00:02.0"]



#: What ``rsync -a`` drops that nothing else in the tree says: KFD topology's ``properties``
#: (the gfx target), ``sriov_totalvfs``, a VFIO device's ``dev`` (its cdev), ``boot_vga``,
#: DMI's ``sys_vendor`` (which hypervisor), no-IOMMU VFIO's group ``name``.
RSYNC_LOSES = frozenset(("apu", "instinct", "mi300x", "flex", "igpu-sriov", "sriov", "mxgpu",
                         "grace-hopper", "bochs-guest", "hyperv", "noiommu", "virtio-guest",
                         "laptop"))


def _rsync_pair(tmp_path: Path, kind: str) -> tuple[SysRoot, SysRoot]:
    """The host of ``kind`` with its ``config`` files, and its ``rsync -a`` capture: links
    and ``config`` kept, every text attribute dropped (each reads shorter than the 4096
    bytes ``stat`` reports)."""
    live = MACHINES[kind](tmp_path / "live")
    live.add_config()
    captured = MACHINES[kind](tmp_path / "captured")
    captured.add_config()
    captured.drop_like_rsync()
    folder = captured.root / "sys/bus/pci/devices" / live.functions[-1]
    assert not (folder / "vendor").exists() and (folder / "config").is_file()
    return live, captured


@pytest.mark.parametrize("kind", sorted(set(MACHINES) - RSYNC_LOSES))
def test_rsync_capture_answers_like_the_host(tmp_path: Path, kind: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Each function's ids, class and modalias come from its ``config``: every answer is
    the host's."""
    live, captured = _rsync_pair(tmp_path, kind)
    assert answers(captured.root, capsys) == answers(live.root, capsys)


@pytest.mark.parametrize("kind", sorted(RSYNC_LOSES))
def test_rsync_capture_finds_the_hosts_functions(tmp_path: Path, kind: str) -> None:
    """Where the capture lost files no other says, every function is still there with the
    host's ids, class, driver and group, and the same GPUs."""
    live, captured = _rsync_pair(tmp_path, kind)

    def seen(root: Path) -> tuple[object, ...]:
        model = gpuwatch.scan(root)
        return (tuple((f.addr, f.vendor_id, f.device_id, f.class_, f.driver, f.iommu_group,
                       f.physfn) for f in model.functions()),
                tuple(g.addr for g in model.probe("detect-vfio").gpus))

    assert seen(captured.root) == seen(live.root)
