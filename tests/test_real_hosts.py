"""Probe answers on trees laid out like real machines of many kinds, and as capture tools
copy them (links flattened into folders, links in the kernel's relative spelling)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_helpers import run_main as cli

import gpuwatch
from gpuwatch.core.kfd import format_gfx_target
from gpuwatch.core.modes import group_mode
from gpuwatch.core.pci import canonical_addr, is_pci_addr
from gpuwatch.errors import UsageError
from gpuwatch.jsonout import jsonable
from gpuwatch.report import build_status, passthrough_gpus
from gpuwatch.service.metrics import Metrics
from gpuwatch.service.nfd import feature_labels
from gpuwatch.switch.hostops import check_write
from gpuwatch.testing import SysRoot, example_gpu_host
from gpuwatch.testing.machines import (
    amd_apu_dgpu_host,
    bmc_server_host,
    instinct_host,
    mi300x_cpx_host,
    turing_desktop_host,
    vm_guest_host,
    vmd_host,
)

NV = "0000:01:00.0"




def probe(root: SysRoot | Path, action: str, **kw: object) -> object:
    base = root.root if isinstance(root, SysRoot) else root
    return jsonable(gpuwatch.scan(base).probe(action, **kw))  # type: ignore[arg-type]


# ------------------------------------------------------------ detect-gpu: a GPU on nvidia


def test_detect_gpu_needs_a_display_function_on_nvidia(host: SysRoot) -> None:
    assert probe(host, "detect-gpu") is True
    # Module loaded, CDI spec present, but the only NVIDIA card is on vfio-pci.
    host.bind(NV, "vfio-pci")
    assert host.root.joinpath("sys/module/nvidia").is_dir()
    assert probe(host, "detect-gpu") is False
    assert probe(host, "detect-host-devices")["gpu"] is False  # type: ignore[index]
    host.bind(NV, "nvidia")
    assert probe(host, "detect-gpu") is True
    # The card removed (hot-unplugged): the module and spec stay, the GPU is gone.
    host.remove_function(NV)
    assert probe(host, "detect-gpu") is False


@pytest.mark.parametrize("kind", ["bmc", "vm"])
def test_detect_gpu_follows_3d_controllers(tmp_path: Path, kind: str) -> None:
    s = bmc_server_host(tmp_path / "h") if kind == "bmc" else vm_guest_host(tmp_path / "h")
    assert probe(s, "detect-gpu") is True  # A100 / T4 are 3D controllers (0x0302)
    for addr in [a for a in s.functions if s.device_dir(a).joinpath("vendor").read_text()
                 .strip() == "0x10de"]:
        s.bind(addr, "vfio-pci")
    assert probe(s, "detect-gpu") is False


def test_status_and_metrics_use_the_same_rule(host: SysRoot) -> None:
    host.bind(NV, "vfio-pci")
    model = gpuwatch.scan(host.root)
    report = build_status(model, gpuwatch.scan(host.root).probe("memlock"))
    assert report.nvidia_usable is False
    metrics = Metrics()
    metrics.nvidia_usable.set(1 if model.probe("detect-gpu") else 0)
    assert metrics.registry.get_sample_value("gpuwatch_nvidia_gpu_usable") == 0


# ------------------------------------------------------------ captured trees


def amd_workstation(root: Path) -> SysRoot:
    """A Ryzen workstation with a Radeon RX 7900 XTX on amdgpu (gfx1100)."""
    s = SysRoot(root)
    s.add_bridge("0000:00:01.1", iommu_group=2)
    s.add_function("0000:03:00.0", parent="0000:00:01.1", vendor="0x1002", device="0x744c",
                   driver="amdgpu", iommu_group=14, subsystem_vendor="0x1002")
    s.add_function("0000:03:00.1", parent="0000:00:01.1", vendor="0x1002", device="0xab30",
                   klass="0x040300", driver="snd_hda_intel", iommu_group=14)
    s.add_drm("card0", "0000:03:00.0")
    s.add_drm("renderD128", "0000:03:00.0")
    s.add_kfd_node(0, 0)
    s.add_kfd_node(1, 110000)
    s.add_dev_node("/dev/kfd")
    return s


def test_kernel_spelling_of_the_device_link(tmp_path: Path) -> None:
    s = amd_workstation(tmp_path / "h")
    link = s.root / "sys/class/drm/card0"
    assert os.readlink(link / "device") == "../../../0000:03:00.0"
    assert os.readlink(s.root / "sys/bus/pci/devices/0000:03:00.0").startswith("../../../devices/")
    assert probe(s, "detect-amd-gpu") is True
    # card0 copied as a folder, its device link kept as the kernel spells it: from the new
    # place it leads nowhere, yet it still names the card.
    s.flatten_link("sys/class/drm/card0")
    assert not (link / "device").exists() and os.path.islink(link / "device")
    assert probe(s, "detect-amd-gpu") is True
    assert probe(s, "detect-host-devices")["render_node"] == "/dev/dri/renderD128"  # type: ignore[index]


@pytest.mark.parametrize("nested", [(), ("driver",), ("driver", "iommu_group")])
def test_flattened_drm_device_folder_still_names_the_card(tmp_path: Path,
                                                          nested: tuple[str, ...]) -> None:
    s = amd_workstation(tmp_path / "h")
    s.flatten_link("sys/class/drm/card0", nested=("device", *nested))
    device = s.root / "sys/class/drm/card0/device"
    assert device.is_dir() and not device.is_symlink()
    assert (device / "vendor").read_text() == "0x1002\n"
    assert probe(s, "detect-amd-gpu") is True
    hd = probe(s, "detect-host-devices")
    assert hd["amd_gpu"] is True and hd["amd_gfx_target"] == "gfx1100"  # type: ignore[index]
    assert hd["render_node"] == "/dev/dri/renderD128"  # type: ignore[index]


def test_whole_captured_tree_answers_like_the_host(tmp_path: Path) -> None:
    live = amd_workstation(tmp_path / "live")
    captured = amd_workstation(tmp_path / "captured")
    captured.capture()
    entry = captured.root / "sys/bus/pci/devices/0000:03:00.0"
    assert entry.is_dir() and not entry.is_symlink()
    assert (entry / "driver").is_dir() and not (entry / "driver").is_symlink()
    assert (entry / "iommu_group").is_dir() and not (entry / "iommu_group").is_symlink()
    for action in ("detect-vfio", "detect-amd-gpu", "amd-gfx-version", "amd-gfx-target",
                   "detect-host-devices"):
        assert probe(captured, action) == probe(live, action), action
    fn = gpuwatch.scan(captured.root).function("0000:03:00.0")
    assert (fn.driver, fn.iommu_group) == ("amdgpu", 14)


def test_captured_nvidia_host_keeps_groups_and_drivers(tmp_path: Path) -> None:
    live = example_gpu_host(tmp_path / "live")
    captured = example_gpu_host(tmp_path / "captured")
    captured.capture()
    assert probe(captured, "detect-vfio") == probe(live, "detect-vfio")
    assert probe(captured, "detect-gpu") is True


def test_flattened_driver_without_uevent_driver_line_reads_unbound(tmp_path: Path) -> None:
    s = amd_workstation(tmp_path / "h")
    s.capture()
    s.set_attr("0000:03:00.0", "uevent", "PCI_SLOT_NAME=0000:03:00.0\n")
    # The bus entry is a copy now: rewrite its uevent too, as a garbage capture would hold.
    (s.root / "sys/bus/pci/devices/0000:03:00.0/uevent").write_text("garbage\n")
    fn = gpuwatch.scan(s.root).function("0000:03:00.0")
    assert fn.driver == ""  # no claim the tree cannot back


# ------------------------------------------------------------ PCI domains of 4 to 8 digits


def test_address_parser_accepts_wide_domains() -> None:
    assert canonical_addr("10000:01:00.0") == "10000:01:00.0"
    assert canonical_addr("0001000A:01:00.0") == "1000a:01:00.0"
    assert canonical_addr("FFFFFFFF:ff:1F.7") == "ffffffff:ff:1f.7"
    assert canonical_addr("00000000:01:00.0") == "0000:01:00.0"
    for bad in ("000:01:00.0", "123456789:01:00.0", "10000:1:00.0", "10000:01:00.8",
                "10000:01:00.0\n", " 0000:01:00.0", "01:00.0", "g000:01:00.0"):
        assert canonical_addr(bad) is None, bad
    assert is_pci_addr("10000:01:00.0") and not is_pci_addr("pci10000:00")


def test_vmd_domain_is_in_the_model_and_every_report(tmp_path: Path) -> None:
    s = vmd_host(tmp_path / "h")
    assert s.devpath("10000:01:00.0") == (
        "/devices/pci0000:00/0000:00:0e.0/pci10000:00/10000:00:01.0/10000:01:00.0")
    model = gpuwatch.scan(s.root)
    gpus = model.probe("detect-vfio").gpus
    vmd_gpu = next(g for g in gpus if g.addr == "10000:01:00.0")
    assert [m.addr for m in vmd_gpu.group_members] == ["10000:01:00.0", "10000:01:00.1"]
    assert model.probe("display-driver", addr="10000:01:00.0") == "vfio-pci"
    assert model.probe("group-in-mode", addr="10000:01:00.1", mode="vfio") is True
    listed = {g.addr: g for g in passthrough_gpus(model)}
    assert "domain='0x10000'" in listed["10000:01:00.0"].functions[0].hostdev_xml  # type: ignore[operator]
    status = build_status(model, model.probe("memlock"))
    assert {g.addr: g.mode for g in status.gpus}["10000:01:00.0"] == "vfio"
    labels = feature_labels(model.probe("detect-vfio"), False, False, "", lambda v: v)
    assert labels["gpuwatch.gpu.count"] == "2" and labels["gpuwatch.gpu.vfio.count"] == "1"
    check_write("/sys/bus/pci/drivers/vfio-pci/bind", "10000:01:00.0")  # no UnsafeStep
    check_write("/sys/bus/pci/devices/10000:01:00.0/driver_override", "vfio-pci")


def test_vmd_domain_on_the_command_line(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    s = vmd_host(tmp_path / "h")
    code, out, err = cli(capsys, "probe", "display-driver", "--addr", "10000:01:00.0",
                         "--root", str(s.root))
    assert (code, json.loads(out)["result"], err) == (0, "vfio-pci", "")
    code, out, _ = cli(capsys, "probe", "current-mode", "--addr", "0001000A:01:00.0",
                       "--root", str(s.root))
    assert code == 1  # a well-formed address of a function that is not there
    code, _, err = cli(capsys, "probe", "display-driver", "--addr", "123456789:01:00.0",
                       "--root", str(s.root))
    assert code == 2 and "not a PCI address" in err and err[-1] == "\n" and err.count("\n") == 1
    code, out, _ = cli(capsys, "mode", "--addr", "10000:01:00.1", "--root", str(s.root),
                       "--json", "--no-daemon")
    assert code == 0 and json.loads(out)["mode"] == "vfio"
    code, out, _ = cli(capsys, "list", "--root", str(s.root), "--json", "--no-daemon")
    assert "10000:01:00.0" in {g["addr"] for g in json.loads(out)}
    code, out, _ = cli(capsys, "status", "--root", str(s.root), "--no-daemon")
    assert code == 0 and "GPU 10000:01:00.0" in out


def test_wide_domain_in_the_watcher_from_uevents(tmp_path: Path) -> None:
    from gpuwatch.core.uevent import UEvent
    from gpuwatch.hostfs.scan import HostPaths, observe

    s = vmd_host(tmp_path / "h")
    s.unbind("10000:01:00.0")
    props = s.uevent_props("unbind", "10000:01:00.0")
    seen = observe(HostPaths(s.root), gpuwatch.scan(s.root).tables, UEvent.from_properties(props))
    assert [(o.addr, o.driver) for o in seen] == [("10000:01:00.0", "")]  # type: ignore[union-attr]


# ------------------------------------------------------------ amd-gfx-target


@pytest.mark.parametrize(
    ("version", "target"),
    [(90010, "gfx90a"), (90012, "gfx90c"), (90402, "gfx942"), (100306, "gfx1036"),
     (110000, "gfx1100"), (90000, "gfx900"), (100300, "gfx1030"), (120001, "gfx1201"),
     (0, ""),
     # Every value kfd_device.c gives a GPU, as LLVM names the processor.
     (70000, "gfx700"), (70001, "gfx701"), (80001, "gfx801"), (80002, "gfx802"),
     (80003, "gfx803"), (90002, "gfx902"), (90004, "gfx904"), (90006, "gfx906"),
     (90008, "gfx908"), (90400, "gfx940"), (90401, "gfx941"), (90500, "gfx950"),
     (100100, "gfx1010"), (100101, "gfx1011"), (100102, "gfx1012"), (100103, "gfx1013"),
     (100301, "gfx1031"), (100302, "gfx1032"), (100303, "gfx1033"), (100304, "gfx1034"),
     (100305, "gfx1035"), (110001, "gfx1101"), (110002, "gfx1102"), (110003, "gfx1103"),
     (110500, "gfx1150"), (110501, "gfx1151"), (110502, "gfx1152"), (110503, "gfx1153"),
     (120000, "gfx1200")],
)
def test_gfx_target_rule(version: int, target: str) -> None:
    assert format_gfx_target(version) == target


@pytest.mark.parametrize(
    ("gfx", "device", "version", "target"),
    [(90010, "0x740f", "9.0.0", "gfx90a"), (90402, "0x74a1", "9.4.0", "gfx942")],
)
def test_instinct_topologies(tmp_path: Path, gfx: int, device: str, version: str,
                             target: str) -> None:
    s = instinct_host(tmp_path / "h", gfx=gfx, device=device, cards=3)
    assert probe(s, "amd-gfx-version") == version
    assert probe(s, "amd-gfx-target") == target
    hd = probe(s, "detect-host-devices")
    assert (hd["amd_gpu"], hd["amd_gfx_version"], hd["amd_gfx_target"]) == (  # type: ignore[index]
        True, version, target)


def test_gfx_target_empty_without_kfd_or_amd_card(host: SysRoot, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert probe(host, "amd-gfx-target") == ""
    assert probe(host, "detect-host-devices")["amd_gfx_target"] == ""  # type: ignore[index]
    s = instinct_host(tmp_path / "mi", cards=1)
    code, out, _ = cli(capsys, "probe", "amd-gfx-target", "--root", str(s.root))
    assert (code, json.loads(out)) == (0, {"action": "amd-gfx-target", "result": "gfx90a"})


# ------------------------------------------------------------ unbound groups


def test_all_unbound_group_reads_unbound(host: SysRoot) -> None:
    host.unbind(NV)
    host.unbind("0000:01:00.1")
    model = gpuwatch.scan(host.root)
    members = model.state.group_members(NV)
    assert group_mode(members) == "unbound"
    status = build_status(model, model.probe("memlock"))
    assert {g.addr: g.mode for g in status.gpus}[NV] == "unbound"


def test_mixed_is_for_drivers_of_different_modes(host: SysRoot) -> None:
    host.bind("0000:01:00.1", "vfio-pci")  # display on nvidia, audio on vfio-pci
    members = gpuwatch.scan(host.root).state.group_members(NV)
    assert group_mode(members) == "mixed"
    host.unbind(NV)  # display unbound, audio on vfio-pci: not all unbound
    assert group_mode(gpuwatch.scan(host.root).state.group_members(NV)) == "mixed"


@pytest.mark.parametrize("captured", [False, True])
def test_amd_card_half_on_vfio_is_mixed(tmp_path: Path, captured: bool,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A Radeon's HDMI audio given to vfio-pci while the display stays on amdgpu is two modes
    at once, as it is beside a display on nvidia: not `host driver`, which says the whole
    group is the host's."""
    s = amd_apu_dgpu_host(tmp_path / "h")
    dgpu, audio = "0000:03:00.0", "0000:03:00.1"
    assert group_mode(gpuwatch.scan(s.root).state.group_members(dgpu)) == "host driver"
    s.bind(audio, "vfio-pci")
    if captured:
        s.capture()
    model = gpuwatch.scan(s.root)
    assert group_mode(model.state.group_members(dgpu)) == "mixed"
    modes = {g.addr: g.mode for g in build_status(model, model.probe("memlock")).gpus}
    assert modes == {dgpu: "mixed", "0000:12:00.0": "host driver"}
    code, out, _ = cli(capsys, "mode", "--addr", dgpu, "--root", str(s.root))
    assert (code, out.splitlines()[0]) == (0, f"{dgpu} (IOMMU group 5): mixed")
    code, out, _ = cli(capsys, "status", "--json", "--root", str(s.root))
    assert {g["addr"]: g["mode"] for g in json.loads(out)["gpus"]}[dgpu] == "mixed"


def test_usage_error_names_the_accepted_form(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="4 to 8"):
        gpuwatch.scan(tmp_path).probe("display-driver", addr="1:2:3")


# ------------------------------------------------------------ IOMMU asked for, off in firmware


@pytest.mark.parametrize(
    ("cmdline", "kind"),
    [
        # The kernel reads intel_iommu= as a comma list (on, off, igfx_off, sm_on, …): these
        # are the spellings passthrough guides and the kernel's own idxd docs give.
        ("BOOT_IMAGE=/vmlinuz-6.8.0 root=UUID=6e28 ro quiet intel_iommu=on,igfx_off iommu=pt",
         "intel"),
        ("BOOT_IMAGE=/vmlinuz-6.8.0 ro intel_iommu=on,sm_on iommu=pt", "intel"),
        ("ro intel_iommu=sm_on,on", "intel"),
        ("ro amd_iommu=on,force_isolation iommu=pt", "amd"),
        # Asked for and then taken back: the last word counts, as the kernel parses it.
        ("ro intel_iommu=on intel_iommu=off", ""),
        ("ro intel_iommu=on,off", ""),
        ("ro intel_iommu=igfx_off", ""),
    ],
)
def test_iommu_asked_for_in_a_comma_list_but_off_in_firmware(tmp_path: Path, cmdline: str,
                                                             kind: str) -> None:
    """VT-d/AMD-Vi off in the firmware: no IOMMU unit in sys/class/iommu, no group. The
    command line still says which IOMMU was asked for, and so what `status` must advise."""
    s = SysRoot(tmp_path / "h")
    s.add_bridge("0000:00:01.0", iommu_group=None)
    s.add_function(NV, parent="0000:00:01.0", device="0x2204", driver="nvidia", iommu_group=None)
    s.set_cmdline(cmdline)
    vfio = probe(s, "detect-vfio")
    assert (vfio["iommu_enabled"], vfio["iommu_kind"]) == (False, kind)  # type: ignore[index]
    model = gpuwatch.scan(s.root)
    hint = build_status(model, model.probe("memlock")).iommu.hint
    if kind == "intel":
        assert "enable VT-d in the firmware" in hint and "add intel_iommu" not in hint
    elif kind == "":
        assert "to the kernel command line" in hint


@pytest.mark.parametrize(
    ("cmdline", "off"),
    [
        ("BOOT_IMAGE=/vmlinuz ro intel_iommu=on iommu=off", "iommu=off"),
        ("ro amd_iommu=on iommu=pt,off", "iommu=pt,off"),
        ("ro iommu=off", "iommu=off"),
    ],
)
def test_iommu_turned_off_on_the_command_line_is_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], cmdline: str, off: str) -> None:
    """x86's ``iommu=off`` sets no_iommu: neither the Intel nor the AMD IOMMU driver starts,
    whatever intel_iommu=on/amd_iommu=on ask (the kind still says what was asked). `status`
    names the parameter to remove instead of sending the operator to the firmware or asking
    for what the command line already has."""
    s = SysRoot(tmp_path / "h")
    s.add_bridge("0000:00:01.0", iommu_group=None)
    s.add_function(NV, parent="0000:00:01.0", device="0x2204", driver="nvidia", iommu_group=None)
    s.set_cmdline(cmdline)
    code, out, _ = cli(capsys, "status", "--json", "--root", str(s.root))
    iommu = json.loads(out)["iommu"]
    assert code == 0 and iommu["enabled"] is False
    assert iommu["hint"].startswith(f"the kernel command line has {off}, which keeps the IOMMU")
    assert "firmware" not in iommu["hint"] and "add intel_iommu" not in iommu["hint"]
    _, text, _ = cli(capsys, "status", "--root", str(s.root))
    assert f"-> the kernel command line has {off}," in text
    model = gpuwatch.scan(s.root)  # the library's report (and a daemon's) says the same
    assert build_status(model, model.probe("memlock")).iommu.hint == iommu["hint"]


def test_iommu_pt_is_no_iommu_off(tmp_path: Path) -> None:
    """``iommu=pt`` (identity default domains, and ``nopt``) keep the IOMMU on: with no group
    the firmware is still what to look at."""
    s = SysRoot(tmp_path / "h")
    s.add_function(NV, device="0x2204", driver="nvidia", iommu_group=None)
    s.set_cmdline("ro intel_iommu=on iommu=pt iommu=nopt")
    model = gpuwatch.scan(s.root)
    assert "enable VT-d in the firmware" in build_status(model, model.probe("memlock")).iommu.hint


def test_virtio_iommu_guest_with_iommu_off(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A guest booted with ``iommu=off`` whose groups come from a virtio-iommu (x86's
    no_iommu stops the Intel and AMD drivers, not virtio's): its unit sits under the
    virtio device and is none of dmar/ivhd/smmu, so the kind is the command line's (none);
    the IOMMU is on and the passed-through GPU is offered, with no hint."""
    s = SysRoot(tmp_path / "g")
    s.add_function("0000:00:03.0", vendor="0x1af4", device="0x1057", klass="0x00ff00",
                   driver="virtio-pci", iommu_group=0)
    s.add_function(NV, device="0x2204",
                   driver="nvidia", iommu_group=1)
    unit = s.root / "sys/devices/pci0000:00/0000:00:03.0/virtio0/iommu/virtio0"
    unit.mkdir(parents=True)
    os.makedirs(s.root / "sys/class/iommu", exist_ok=True)
    os.symlink("../../devices/pci0000:00/0000:00:03.0/virtio0/iommu/virtio0",
               s.root / "sys/class/iommu/virtio0")
    s.set_cmdline("BOOT_IMAGE=/vmlinuz ro console=ttyS0 iommu=off")
    vfio = probe(s, "detect-vfio")
    assert (vfio["iommu_enabled"], vfio["iommu_kind"]) == (True, "")  # type: ignore[index]
    code, out, _ = cli(capsys, "status", "--json", "--root", str(s.root))
    assert code == 0 and json.loads(out)["iommu"] == {"enabled": True, "kind": "", "hint": ""}
    code, out, _ = cli(capsys, "list", "--json", "--root", str(s.root))
    assert code == 0 and [g["addr"] for g in json.loads(out) if not g["kept_for_host"]] == [NV]


# ------------------------------------------------------------ MI300X in CPX partition mode


@pytest.mark.parametrize("captured", [False, True])
def test_mi300x_cpx_node(tmp_path: Path, captured: bool) -> None:
    """The KFD topology of a real 8-GPU MI300X node in CPX mode: two CPU nodes, 64 GPU nodes,
    render minors 128…191, seven of every eight on amdgpu's partition platform devices."""
    s = mi300x_cpx_host(tmp_path / "h")
    if captured:
        s.capture()
        assert not (s.root / "sys/class/drm/renderD129").is_symlink()
    assert probe(s, "detect-amd-gpu") is True
    assert (probe(s, "amd-gfx-version"), probe(s, "amd-gfx-target")) == ("9.4.0", "gfx942")
    hd = probe(s, "detect-host-devices")
    assert hd == {  # type: ignore[comparison-overlap]
        "gpu": False, "amd_gpu": True, "amd_gfx_version": "9.4.0", "amd_gfx_target": "gfx942",
        "devices": [f"/dev/dri/renderD{n}" for n in range(128, 192)] + ["/dev/kfd"],
        "render_node": "/dev/dri/renderD128",
    }
    model = gpuwatch.scan(s.root)
    drm = model.state.drm
    assert (drm["renderD136"].device_addr, drm["renderD136"].device_driver) == (
        "0000:27:00.0", "amdgpu")
    assert (drm["renderD137"].device_addr, drm["renderD137"].device_vendor) == ("", "")
    fn = model.function("0000:27:00.0")
    assert (fn.class_, fn.class_label, fn.driver, fn.iommu_group) == (
        "0x1200", "0x1200", "amdgpu", 1)
    # The contract's GPUs are the display classes (0x03…): a processing accelerator is not one.
    assert probe(s, "detect-vfio")["gpus"] == []  # type: ignore[index]


def test_mi300x_render_node_skips_partition_devices(tmp_path: Path) -> None:
    """With the first GPU's own render node gone, its partition's (no vendor) is passed over
    for the next GPU's."""
    s = mi300x_cpx_host(tmp_path / "h", partitions=2)
    assert probe(s, "detect-host-devices")["render_node"] == "/dev/dri/renderD128"  # type: ignore[index]
    s.remove_drm("renderD128")
    hd = probe(s, "detect-host-devices")
    assert hd["devices"][:2] == ["/dev/dri/renderD129", "/dev/dri/renderD130"]  # type: ignore[index]
    assert hd["render_node"] == "/dev/dri/renderD130"  # type: ignore[index]


# ------------------------------------------------------------ root port in the GPU group


def test_turing_desktop_root_port_shares_the_group(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The common consumer layout: the CPU root port without ACS in the card's group, and a
    Turing card's four functions (VGA, audio, USB-C, UCSI)."""
    s = turing_desktop_host(tmp_path / "h")
    gpus = {g["addr"]: g for g in probe(s, "detect-vfio")["gpus"]}  # type: ignore[index]
    assert list(gpus) == ["0000:00:02.0", "0000:01:00.0"]
    members = [(m["addr"], m["class_label"], m["driver"]) for m in gpus[NV]["group_members"]]
    assert members == [("0000:00:01.0", "PCI bridge", "pcieport"),
                       (NV, "VGA controller", "nvidia"),
                       ("0000:01:00.1", "Audio device", "snd_hda_intel"),
                       ("0000:01:00.2", "USB controller", "xhci_hcd"),
                       ("0000:01:00.3", "0x0c80", "nvidia-gpu")]
    assert probe(s, "detect-gpu") is True
    hd = probe(s, "detect-host-devices")
    assert hd["render_node"] == "/dev/dri/renderD128"  # type: ignore[index]  # the iGPU: first
    model = gpuwatch.scan(s.root)
    listed = {g.addr: g for g in passthrough_gpus(model)}
    # The bridge stays with the host: a block for each of the card's four functions only.
    assert [f.addr for f in listed[NV].functions] == [NV, "0000:01:00.1", "0000:01:00.2",
                                                      "0000:01:00.3"]
    # The iGPU has boot_vga 1 but is not the only display function: not kept.
    assert listed["0000:00:02.0"].kept_for_host is False
    # The port stays on pcieport: the plan moves the card's four functions and nothing else.
    code, out, err = cli(capsys, "probe", "plan", "--mode", "vfio", "--addr", NV,
                       "--root", str(s.root))
    assert (code, err) == (0, "")
    overrides = [step["path"].split("/")[-2] for step in json.loads(out)["result"]
                 if step["kind"] == "write" and step["path"].endswith("/driver_override")
                 and step["value"] == "vfio-pci"]
    assert overrides == [NV, "0000:01:00.1", "0000:01:00.2", "0000:01:00.3"]
    assert "0000:00:01.0" not in out


def test_turing_desktop_captured_answers_like_the_host(tmp_path: Path) -> None:
    live = turing_desktop_host(tmp_path / "live")
    captured = turing_desktop_host(tmp_path / "captured")
    captured.capture()
    for action in ("detect-vfio", "detect-gpu", "detect-host-devices"):
        assert probe(captured, action) == probe(live, action), action
