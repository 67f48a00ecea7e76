"""The kernel's own sysfs is read on trust, a copy never is.

A scan of the root ``/`` (or of any root whose ``sys`` is a sysfs mount) takes the kernel's
links as the truth and reads attributes without the checks that guard a tree of unknown
origin; these tests hold those shortcuts to the answers of the careful path, on this
machine's real /sys, and check that no fixture or copy is ever taken for the kernel's."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

import gpuwatch
from gpuwatch.core.hostkind import HostKind
from gpuwatch.hostfs import scan as scan_mod
from gpuwatch.hostfs.files import in_tree, read_attr, read_kernel_attr
from gpuwatch.hostfs.hostkind import read_host_kind
from gpuwatch.hostfs.scan import HostPaths, fs_type, scan_functions
from gpuwatch.testing import SysRoot
from gpuwatch.testing.machines import single_gpu_desktop, vm_guest_host, x86_cpuinfo

REAL_SYSFS = fs_type("/sys") == "sysfs" and os.path.isdir("/sys/bus/pci/devices")
needs_sysfs = pytest.mark.skipif(not REAL_SYSFS, reason="needs the kernel's sysfs at /sys")


@needs_sysfs
def test_the_real_sys_is_live_and_a_fixture_is_not(tmp_path: Path) -> None:
    assert HostPaths("/").live
    s = single_gpu_desktop(tmp_path / "h")
    assert not HostPaths(str(s.root)).live
    # A fixture on tmpfs (where the benchmarks build theirs) is no sysfs either.
    if os.access("/dev/shm", os.W_OK):
        shm = Path(tempfile.mkdtemp(dir="/dev/shm"))
        try:
            SysRoot(shm).add_function("0000:01:00.0", driver="nvidia")
            assert fs_type(str(shm)) == "tmpfs"
            assert not HostPaths(str(shm)).live
        finally:
            shutil.rmtree(shm, ignore_errors=True)


@needs_sysfs
def test_kernel_attrs_read_as_the_careful_reader_reads_them() -> None:
    bus = Path("/sys/bus/pci/devices")
    names = sorted(os.listdir(bus))
    assert names, "a VM with no PCI function"
    for name in names:
        folder = os.path.realpath(bus / name)
        for attr in ("vendor", "device", "class", "boot_vga", "no_such_attr"):
            assert read_kernel_attr(f"{folder}/{attr}") == read_attr(f"{folder}/{attr}")
    # A folder where a file is expected, and a path with a NUL, read as nothing.
    assert read_kernel_attr(os.path.realpath(bus / names[0])) == ""
    assert read_kernel_attr("/sys/\0") == ""


@needs_sysfs
def test_a_scan_of_the_live_tree_equals_the_careful_scan(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    trusted = scan_functions(HostPaths("/"))
    monkeypatch.setattr(HostPaths, "live", property(lambda self: False))
    careful = scan_functions(HostPaths("/"))
    assert trusted == careful
    assert {f.addr for f in trusted} == set(os.listdir("/sys/bus/pci/devices"))


@needs_sysfs
def test_a_live_tree_takes_the_iommu_class_as_the_whole_truth(monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    searched: list[str] = []
    real = scan_mod.iommu_units_in_devices
    monkeypatch.setattr(scan_mod, "iommu_units_in_devices",
                        lambda devices: searched.append(devices) or real(devices))
    model = gpuwatch.scan("/")
    assert searched == []
    units = os.listdir("/sys/class/iommu") if os.path.isdir("/sys/class/iommu") else []
    assert model.state.iommu.kind == scan_mod.iommu_kind(units, read_attr("/proc/cmdline"))


def test_a_copy_still_searches_the_devices_for_its_iommu(tmp_path: Path) -> None:
    """A copy whose ``class/iommu`` lost its links finds the unit under the devices."""
    s = vm_guest_host(tmp_path / "h")
    (s.root / "sys/devices/virtual/iommu/dmar0").mkdir(parents=True)
    (s.root / "sys/class/iommu").mkdir(parents=True, exist_ok=True)
    assert os.listdir(s.root / "sys/class/iommu") == []
    assert not HostPaths(str(s.root)).live
    assert gpuwatch.scan(str(s.root)).state.iommu.kind == "intel"


def test_in_tree_at_the_real_root_names_the_same_file() -> None:
    assert in_tree("/", "proc/self/status") == "/proc/self/status"
    assert in_tree("/", "/etc/../etc/hostname") == "/etc/../etc/hostname"
    with open(in_tree("/", "proc/self/status"), encoding="utf-8") as f:
        assert f"Pid:\t{os.getpid()}" in f.read()


def test_the_cpu_modalias_decides_before_cpuinfo(tmp_path: Path) -> None:
    """Both hold the same bits on a real host; the short sysfs file is read first, and
    ``proc/cpuinfo`` (which the kernel formats for every processor) only where it says
    nothing."""
    s = vm_guest_host(tmp_path / "h")
    cpu = s.root / "sys/devices/system/cpu"
    cpu.mkdir(parents=True, exist_ok=True)
    (s.root / "proc").mkdir(exist_ok=True)
    (s.root / "proc/cpuinfo").write_text(x86_cpuinfo(hypervisor=False))
    (cpu / "modalias").write_text("cpu:type:x86,ven0000fam0006mod008F:feature:,0000,009F\n")
    assert read_host_kind(str(s.root)).hypervisor != ""  # the modalias's flag, not cpuinfo's
    (cpu / "modalias").write_text("cpu:type:x86,ven0000fam0006mod008F:feature:,0000,009E\n")
    assert read_host_kind(str(s.root)) == HostKind("x86", "")
    # A modalias that names no architecture leaves the answer to cpuinfo.
    (cpu / "modalias").write_text("garbage\n")
    (s.root / "proc/cpuinfo").write_text(x86_cpuinfo(hypervisor=True))
    assert read_host_kind(str(s.root)).arch == "x86"
    assert read_host_kind(str(s.root)).hypervisor != ""


def test_cpuinfo_reads_only_its_first_processor_after_leading_blank_lines() -> None:
    from gpuwatch.core.hostkind import cpuinfo_facts
    first = x86_cpuinfo(hypervisor=False)
    assert cpuinfo_facts("\n\n" + first + "\n" + x86_cpuinfo(hypervisor=True)) == ("x86", False)
