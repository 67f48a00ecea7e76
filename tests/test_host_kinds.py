"""Hosts that are no x86 bare-metal machine (an arm64 server, VM guests) told how to have an
IOMMU in their own terms; DRM nodes of non-PCI devices (virtio-gpu's ``virtio0``, Hyper-V's
synthetic video) read alike through links and from a capture's folders; and the text
tables of `status` and `mode` in line whatever the widths of the addresses (VMD's
five-digit domain beside the usual four)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_helpers import run_main as cli

import gpuwatch
from gpuwatch.core.hostkind import (
    UNKNOWN_HOST,
    HostKind,
    cpuinfo_facts,
    host_kind,
    hypervisor_from_dmi,
    hypervisor_from_pci_root,
    modalias_facts,
)
from gpuwatch.core.pci import is_pci_addr
from gpuwatch.core.reporttext import X86_IOMMU_NEEDS, iommu_hint, iommu_needs
from gpuwatch.hostfs.hostkind import read_host_kind
from gpuwatch.testing import SysRoot
from gpuwatch.testing.machines import (
    ALTRA_GPU,
    ARM64_CPUINFO,
    HYPERV_GPU,
    ampere_altra_host,
    bochs_guest_with_l4,
    hyperv_gpu_guest,
    jetson_orin_host,
    virtio_gpu_guest,
    virtio_gpu_viommu_guest,
    vmd_host,
    x86_cpuinfo,
)

#: The x86 text every bare-metal x86 host (or one nothing is known of) keeps.
X86_HINT = ("enable VT-d/AMD-Vi in the firmware and add intel_iommu=on iommu=pt (Intel) or "
            "amd_iommu=on iommu=pt (AMD) to the kernel command line, then reboot")


def status(root: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    code, out, err = cli(capsys, "status", "--no-daemon", "--root", str(root), *extra)
    assert err == ""
    return code, out


def hint_of(root: Path, capsys: pytest.CaptureFixture[str]) -> str:
    code, out = status(root, capsys, "--json")
    assert code == 0
    hint: str = json.loads(out)["iommu"]["hint"]
    return hint


def captured(s: SysRoot) -> SysRoot:
    """``s`` as ``cp -rL`` leaves it: the capture's flattened links, and the DMI class link
    a folder too."""
    s.capture()
    if (s.root / "sys/class/dmi/id").is_symlink():
        s.flatten_link("sys/class/dmi/id")
    return s


# ------------------------------------------------------------ the facts, pure


def test_cpuinfo_names_the_architecture_and_the_hypervisor_flag() -> None:
    assert cpuinfo_facts(x86_cpuinfo()) == ("x86", False)
    assert cpuinfo_facts(x86_cpuinfo(hypervisor=True)) == ("x86", True)
    assert cpuinfo_facts(ARM64_CPUINFO) == ("arm64", None)
    # Only the first processor counts; garbage says nothing.
    assert cpuinfo_facts(x86_cpuinfo() + "flags\t: hypervisor\n") == ("x86", False)
    for junk in ("", "\0\0\0", "no colon here\n", "flags: hypervisor\n", "\ufffd" * 40):
        assert cpuinfo_facts(junk) == ("", None), junk


def test_cpu_modalias_says_the_same_for_a_tree_without_proc() -> None:
    x86 = "cpu:type:x86,ven0000fam0006mod008F:feature:,0000,0001,0002,009E,00C0"
    assert modalias_facts(x86) == ("x86", False)
    assert modalias_facts(x86.replace("009E", "009F")) == ("x86", True)
    assert modalias_facts("cpu:type:aarch64:feature:,0000,0001,0002") == ("arm64", None)
    assert modalias_facts("garbage") == ("", None)


@pytest.mark.parametrize(("vendor", "product", "xen", "name"), [
    ("QEMU", "Standard PC (Q35 + ICH9, 2009)", "", "kvm"),
    ("Red Hat", "KVM", "", "kvm"),
    ("OpenStack Foundation", "OpenStack Nova", "", "kvm"),
    ("Microsoft Corporation", "Virtual Machine", "", "hyperv"),
    ("Microsoft Corporation", "Surface Laptop 5", "", ""),  # Microsoft's own hardware
    ("Amazon EC2", "g5.xlarge", "", "amazon"),
    ("Amazon EC2", "g5.metal", "", ""),  # a bare-metal instance is no guest
    ("Google", "Google Compute Engine", "", "google"),
    ("VMware, Inc.", "VMware7,1", "", "vmware"),
    ("innotek GmbH", "VirtualBox", "", "virtualbox"),
    ("", "", "xen", "xen"),
    ("Supermicro", "SYS-420GP-TNR", "", ""),
])
def test_dmi_strings_name_the_hypervisor(vendor: str, product: str, xen: str,
                                         name: str) -> None:
    assert hypervisor_from_dmi(vendor, product, xen) == name


def test_the_x86_flag_decides_and_dmi_only_names() -> None:
    """A bare-metal x86 host whose board carries a hypervisor's DMI strings (a reused image,
    an odd vendor) is no guest; a guest whose DMI names nothing is one all the same."""
    assert host_kind(x86_cpuinfo(), "", "QEMU", "KVM") == HostKind("x86", "")
    assert host_kind(x86_cpuinfo(hypervisor=True), "", "", "") == HostKind("x86", "other")
    assert host_kind(ARM64_CPUINFO, "", "QEMU", "KVM Virtual Machine") == HostKind("arm64", "kvm")
    assert host_kind("", "", "", "") == UNKNOWN_HOST


def test_a_device_tree_virt_machine_is_a_kvm_guest_without_dmi() -> None:
    """QEMU's arm64 ``virt`` machine booted straight into the kernel has no DMI strings;
    its device tree's root ``compatible`` names it. Another board's names nothing."""
    virt = "linux,dummy-virt"
    assert host_kind(ARM64_CPUINFO, "", "", "", "", virt) == HostKind("arm64", "kvm")
    assert host_kind(ARM64_CPUINFO, "", "", "", "", f"acme,board\0{virt}") == \
        HostKind("arm64", "kvm")
    assert host_kind(ARM64_CPUINFO, "", "", "", "",
                     "nvidia,p3737-0000+p3701-0000\0nvidia,tegra234") == HostKind("arm64", "")
    # A name from DMI wins over the tree's.
    assert host_kind(ARM64_CPUINFO, "", "Microsoft Corporation", "Virtual Machine", "",
                     virt) == HostKind("arm64", "hyperv")


def test_a_rust_vmm_guest_is_named_by_its_pci_root() -> None:
    """Cloud Hypervisor's and Firecracker's guests have no DMI strings; their PCI host
    bridge at 0000:00:00.0 (8086:0d57, no real part) names them. DMI wins where it names
    one, and a bare-metal host (no hypervisor flag) stays one whatever its ids."""
    guest = x86_cpuinfo(hypervisor=True)
    assert hypervisor_from_pci_root("0x8086", "0x0d57\n") == "rust-vmm"
    assert hypervisor_from_pci_root("0x8086", "0x29c0") == ""  # QEMU q35's MCH
    assert host_kind(guest, "", "", "", pci_root=("0x8086", "0x0D57")) == \
        HostKind("x86", "rust-vmm")
    assert host_kind(guest, "", "QEMU", "Standard PC", pci_root=("0x8086", "0x0d57")) == \
        HostKind("x86", "kvm")
    assert host_kind(x86_cpuinfo(), "", "", "", pci_root=("0x8086", "0x0d57")) == \
        HostKind("x86", "")


def _rust_vmm_guest(at: Path) -> SysRoot:
    """A Firecracker guest as one was captured: the 8086:0d57 root, virtio functions, an
    H100 on nvidia, no IOMMU group, no DMI."""
    s = SysRoot(at)
    s.set_cpuinfo(x86_cpuinfo(hypervisor=True))
    s.add_function("0000:00:00.0", vendor="0x8086", device="0x0d57", klass="0x060000")
    s.add_function("0000:00:01.0", vendor="0x1af4", device="0x1042", klass="0x018000",
                   driver="virtio-pci")
    s.add_function("0000:00:06.0", vendor="0x10de", device="0x2330", klass="0x030200",
                   driver="nvidia")
    s.add_module("nvidia")
    return s


def test_a_rust_vmm_guest_is_told_what_its_hypervisor_can_give(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    live = _rust_vmm_guest(tmp_path / "live")
    copy = _rust_vmm_guest(tmp_path / "copy")
    copy.capture()
    hint = hint_of(live.root, capsys)
    assert hint.startswith("this is a virtual machine (Cloud Hypervisor or Firecracker)"), hint
    assert "iommu=on" in hint and "Firecracker none" in hint and "QEMU" not in hint
    assert hint_of(copy.root, capsys) == hint


# ------------------------------------------------------------ the advice, pure


def test_x86_and_unknown_hosts_keep_the_x86_advice() -> None:
    for host in (UNKNOWN_HOST, HostKind("x86", "")):
        assert iommu_hint(False, "", "", host) == X86_HINT
        assert iommu_hint(False, "intel", "", host).endswith("enable VT-d in the firmware")
        assert iommu_needs("", host) == f"the IOMMU ({X86_IOMMU_NEEDS})"
        assert iommu_hint(True, "", "", host) == ""


def test_arm64_advice_names_the_smmu_and_no_x86_switch() -> None:
    unit = iommu_hint(False, "arm", "", HostKind("arm64", ""))
    none = iommu_hint(False, "", "", HostKind("arm64", ""))
    assert unit.startswith("an SMMU is registered but no device is in an IOMMU group")
    assert none.startswith("no SMMU is registered") and "do not apply on arm64" in none
    for hint in (unit, none):
        assert "VT-d" not in hint and "intel_iommu=on" not in hint
    # x86's iommu=off means nothing to an arm64 kernel: not named as the cause there.
    assert iommu_hint(False, "", "iommu=off", HostKind("arm64", "")) == none
    # An SMMU says arm64 even where nothing else was read.
    assert iommu_hint(False, "arm", "", UNKNOWN_HOST) == unit


def test_guest_advice_is_a_virtual_iommu_not_the_firmware() -> None:
    kvm = iommu_hint(False, "", "", HostKind("x86", "kvm"))
    assert "-device intel-iommu,intremap=on,caching-mode=on" in kvm
    assert "virtio-iommu-pci" in kvm and "nested virtualisation" in kvm
    hyperv = iommu_hint(False, "", "", HostKind("x86", "hyperv"))
    assert hyperv.startswith("this is a Hyper-V virtual machine, whose hypervisor gives it no "
                             "virtual IOMMU")
    other = iommu_hint(False, "", "", HostKind("x86", "other"))
    assert "if its hypervisor can" in other and "Hyper-V and cloud VMs get none" in other
    arm_guest = iommu_hint(False, "", "", HostKind("arm64", "kvm"))
    assert "-machine virt,iommu=smmuv3" in arm_guest and "intel-iommu" not in arm_guest
    for hint in (kvm, hyperv, other, arm_guest):
        assert "VT-d" not in hint and "in the firmware" not in hint
    # Asked for on the guest's command line: said, with the guest's advice.
    asked = iommu_hint(False, "intel", "", HostKind("x86", "kvm"))
    assert asked.startswith("intel_iommu=on is asked for but no IOMMU group exists: this is a "
                            "virtual machine (QEMU/KVM)")
    # iommu=off in a guest: named first, and the guest still needs its virtual IOMMU.
    off = iommu_hint(False, "intel", "iommu=off", HostKind("x86", "kvm"))
    assert off.startswith("the kernel command line has iommu=off") and "intel-iommu" in off
    assert iommu_needs("", HostKind("x86", "hyperv")) == f"the IOMMU: {hyperv}"


# ------------------------------------------------------------ the trees


HINTS: dict[str, tuple[Callable[[Path], SysRoot], str]] = {
    "altra-unit": (lambda r: ampere_altra_host(r, smmu="unit"),
                   "an SMMU is registered but no device is in an IOMMU group"),
    "altra-none": (lambda r: ampere_altra_host(r, smmu="none"), "no SMMU is registered"),
    "hyperv": (hyperv_gpu_guest, "this is a Hyper-V virtual machine"),
    "virtio-guest": (virtio_gpu_guest, "this is a virtual machine (QEMU/KVM) without a virtual "
                                       "IOMMU: give it one on the host (QEMU: -device intel-iommu"),
    "bochs-guest": (bochs_guest_with_l4, "this is a virtual machine (QEMU/KVM)"),
}


@pytest.mark.parametrize("kind", sorted(HINTS))
def test_status_hint_fits_the_host_through_links_and_in_a_capture(
        tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    build, start = HINTS[kind]
    live = build(tmp_path / "live")
    copy = captured(build(tmp_path / "copy"))
    dmi = copy.root / "sys/class/dmi/id"
    assert dmi.is_dir() and not dmi.is_symlink()
    hint = hint_of(live.root, capsys)
    assert hint.startswith(start), hint
    assert "VT-d" not in hint and "intel_iommu=on iommu=pt" not in hint
    assert hint_of(copy.root, capsys) == hint
    code, text = status(live.root, capsys)
    assert code == 0 and f"          -> {hint}\n" in text


def test_an_arm64_virt_guest_without_dmi_gets_the_guest_advice(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def build(at: Path) -> SysRoot:
        s = ampere_altra_host(at, smmu="none")
        shutil.rmtree(s.root / "sys/devices/virtual/dmi", ignore_errors=True)
        (s.root / "sys/class/dmi/id").unlink(missing_ok=True)
        dt = s.root / "sys/firmware/devicetree/base"
        dt.mkdir(parents=True)
        (dt / "compatible").write_bytes(b"linux,dummy-virt\0")
        return s

    live, copy = build(tmp_path / "live"), build(tmp_path / "copy")
    copy.capture()
    hint = hint_of(live.root, capsys)
    assert hint.startswith("this is a virtual machine (QEMU/KVM)"), hint
    assert "-machine virt,iommu=smmuv3" in hint and "SMMU is registered" not in hint
    assert hint_of(copy.root, capsys) == hint


def test_the_facts_read_alike_in_a_tar_capture(tmp_path: Path) -> None:
    live = hyperv_gpu_guest(tmp_path / "live")
    copy = captured(hyperv_gpu_guest(tmp_path / "copy"))
    copy.pad_like_tar()
    assert read_host_kind(str(live.root)) == HostKind("x86", "hyperv")
    assert read_host_kind(str(copy.root)) == HostKind("x86", "hyperv")


def test_a_tree_without_proc_cpuinfo_reads_the_cpu_modalias(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    s = ampere_altra_host(tmp_path / "h", smmu="none")
    os.unlink(s.root / "proc/cpuinfo")
    os.unlink(s.root / "sys/class/dmi/id")  # and no DMI class link: the devices folder says
    (s.root / "sys/devices/system/cpu").mkdir(parents=True)
    (s.root / "sys/devices/system/cpu/modalias").write_text(
        "cpu:type:aarch64:feature:,0000,0001,0002,0003\n")
    assert read_host_kind(str(s.root)) == HostKind("arm64", "")
    assert hint_of(s.root, capsys).startswith("no SMMU is registered")


def test_garbage_where_the_facts_are_reads_as_nothing_known(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A FIFO, a folder, binary junk or a file far past any page: no hang, no traceback,
    and the kind not known (x86's advice, as before)."""
    s = ampere_altra_host(tmp_path / "h", smmu="none")
    os.unlink(s.root / "proc/cpuinfo")
    os.mkfifo(s.root / "proc/cpuinfo")
    dmi = s.root / "sys/devices/virtual/dmi/id"
    (dmi / "sys_vendor").unlink()
    (dmi / "sys_vendor").mkdir()
    (dmi / "product_name").write_bytes(b"\xff\xfe\0" * 50000)
    (s.root / "sys/hypervisor").mkdir()
    (s.root / "sys/hypervisor/type").symlink_to("../../../../../../../etc/passwd")
    assert read_host_kind(str(s.root)) == UNKNOWN_HOST
    assert hint_of(s.root, capsys) == X86_HINT


@pytest.mark.parametrize(("build", "addr", "start"), [
    (lambda r: ampere_altra_host(r, smmu="none"), ALTRA_GPU, "no SMMU is registered"),
    (hyperv_gpu_guest, HYPERV_GPU, "this is a Hyper-V virtual machine"),
])
def test_a_switch_refused_for_no_group_says_what_this_host_needs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        build: Callable[[Path], SysRoot], addr: str, start: str) -> None:
    s = build(tmp_path / "h")
    code, out, err = cli(capsys, "plan", "vfio", "--addr", addr, "--json", "--no-daemon",
                         "--root", str(s.root))
    reason = json.loads(out)["refused"]["reason"]
    assert code == 1 and err == f"gpuwatch: the switch would be refused: {reason}\n"
    assert reason.startswith(f"{addr} has no IOMMU group: vfio-pci needs the IOMMU: {start}")
    assert "VT-d" not in reason and "intel_iommu=on" not in reason


# ------------------------------------------------------------ DRM nodes of non-PCI devices


@pytest.mark.parametrize("build", [hyperv_gpu_guest, virtio_gpu_guest, virtio_gpu_viommu_guest,
                                   jetson_orin_host])
def test_drm_nodes_of_other_buses_read_alike_in_a_capture(
        tmp_path: Path, build: Callable[[Path], SysRoot]) -> None:
    """The device a node hangs from read from the folder a capture copied in place of its
    ``device`` link, as through the link (the devpath aside: a copied node has none)."""
    def nodes(root: Path) -> dict[str, tuple[str, str, str]]:
        return {name: (n.device_addr, n.device_vendor, n.device_driver)
                for name, n in gpuwatch.scan(root).state.drm.items()}

    live = build(tmp_path / "live")
    copy = build(tmp_path / "copy")
    copy.capture()
    assert not (copy.root / "sys/class/drm/card0/device").is_symlink()
    assert nodes(copy.root) == nodes(live.root)
    expected = {hyperv_gpu_guest: ("", "0x1414", "hyperv_drm"),
                virtio_gpu_guest: ("", "0x1af4", "virtio_gpu"),
                virtio_gpu_viommu_guest: ("", "0x1af4", "virtio_gpu"),
                jetson_orin_host: ("", "", "tegra-host1x")}[build]  # type: ignore[index]
    assert nodes(copy.root)["card0"] == expected


# ------------------------------------------------------------ text tables


def _aligned(rows: list[str]) -> bool:
    """Each row's second column (the class label, after the address and its padding) and
    its ``driver:`` start where every other row's do."""
    def second(row: str) -> int:
        after = row[2 + len(row.split()[0]):]
        return len(row) - len(after.lstrip())

    return len({second(r) for r in rows}) == 1 and len({r.find("driver") for r in rows}) == 1


def test_status_rows_line_up_across_address_widths(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """VMD's group: the controller (``0000:00:0e.0``) beside its domain's functions
    (``10000:…``): every row's label and ids start in the same column."""
    s = vmd_host(tmp_path / "h", shared=True)
    code, out = status(s.root, capsys)
    block = out.split("GPU 10000:01:00.0")[1].split("\n\n")[0].splitlines()[1:]
    rows = [r for r in block if r.startswith("  ") and is_pci_addr(r.split()[0])]
    assert [r.split()[0] for r in rows] == ["0000:00:0e.0", "10000:00:01.0", "10000:01:00.0",
                                            "10000:01:00.1", "10000:02:00.0"]
    assert code == 0 and _aligned(rows), block
    # A block of one width is as it always was: two spaces after the address.
    assert "\n  0000:00:02.0  VGA controller       0x8086:0xa780  driver: i915\n" in out


def test_mode_rows_line_up_across_address_widths(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    s = vmd_host(tmp_path / "h", shared=True)
    code, out, err = cli(capsys, "mode", "--addr", "10000:01:00.0", "--no-daemon",
                         "--root", str(s.root))
    # The member rows (a line below them says why the group is kept for the host).
    rows = [r for r in out.splitlines()[1:] if is_pci_addr(r.split()[0])]
    assert code == 0 and len(rows) == 5, (out, err)
    assert "kept for the host: 0000:00:0e.0 (vmd)" in out
    second = {len(r) - len(r[2 + len(r.split()[0]):].lstrip()) for r in rows}
    assert len(second) == 1 and len({len(r) - len(r.split()[-1]) for r in rows}) == 1, out


def test_a_gpu_in_the_vmd_controllers_group_is_kept_for_the_host(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Behind VMD the card shares the controller's IOMMU group: passing that group through
    detaches the controller, and its whole PCI domain (the NVMe drive beside the card) goes
    with it. Not offered by `list`, refused by `mode vfio` (exit 1), the reason named."""
    s = vmd_host(tmp_path / "h", shared=True)
    code, out, _err = cli(capsys, "list", "--json", "--no-daemon", "--root", str(s.root))
    entry = next(g for g in json.loads(out) if g["addr"] == "10000:01:00.0")
    assert code == 0 and entry["kept_for_host"] is True
    assert entry["reason"].startswith("0000:00:0e.0 (vmd) is an Intel VMD controller")
    code, out, err = cli(capsys, "mode", "vfio", "--addr", "10000:01:00.0", "--no-daemon",
                         "--root", str(s.root))
    assert code == 1 and "kept for the host: 0000:00:0e.0 (vmd)" in err, (out, err)
    # A card behind VMD in a group of its own (no controller in it) is offered as before.
    own = vmd_host(tmp_path / "own")
    code, out, _err = cli(capsys, "list", "--json", "--no-daemon", "--root", str(own.root))
    entry = next(g for g in json.loads(out) if g["addr"] == "10000:01:00.0")
    assert code == 0 and entry["kept_for_host"] is False
