"""Probe answers on more kinds of real machine, as their kernels lay them out, live and as
captured (links followed into folders and NUL-padded by ``tar -ch``, or left out): an HGX
H100 with nvidia-drm's nodes after the BMC's ``ast`` card (no render node of its own), an
MI300X node in SPX mode beside its ASPEED BMC (amdgpu's partition devices
``amdgpu_xcp.N`` holding the other minors), a cloud VM whose console is ``simpledrm`` on
the firmware's framebuffer, a q35 guest with a vIOMMU and virtio-gpu at renderD128 beside a
passed-through GPU, a laptop whose renderD128 is the AMD APU's and not the NVIDIA dGPU's,
and a Grace-Hopper (arm64, ACPI) server with its BMC."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import run_main

import gpuwatch
from gpuwatch.jsonout import jsonable
from gpuwatch.testing import SysRoot
from gpuwatch.testing import machines as mach

pytestmark = pytest.mark.timeout(120)


def dgx_h100(root: Path, *, nvswitch_driver: str = "nvidia-nvswitch") -> SysRoot:
    """`hgx_h100_host` with nvidia-drm: card1…8 and renderD128…135 after ast's card0, the
    UVM and capability nodes; the NVSwitches on ``nvswitch_driver`` (``""``: unbound)."""
    s = mach.hgx_h100_host(root, gpus=8)
    # nvidia-drm: one card and one render node per GPU, after ast's card0
    gpus = [a for a in s.functions
            if s.device_dir(a).joinpath("device").read_text().strip() == mach.H100_SXM]
    for i, a in enumerate(gpus):
        s.add_drm(f"card{i + 1}", a)
        s.add_drm(f"renderD{128 + i}", a)
    s.add_module("nvidia_drm")
    for d in ("/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-caps/nvidia-cap1",
              "/dev/nvidia-caps/nvidia-cap2"):
        s.add_dev_node(d)
    if nvswitch_driver != "nvidia-nvswitch":
        for a in s.functions:
            if s.device_dir(a).joinpath("device").read_text().strip() == mach.NVSWITCH:
                if nvswitch_driver:
                    s.bind(a, nvswitch_driver)
                else:
                    s.unbind(a)
    return s

def mi300x_spx_ast(root: Path) -> SysRoot:
    """Eight MI300X in SPX mode: each its card and renderD on the PCI function, seven more
    on amdgpu's partition devices; KFD nodes 0-1 the CPUs, 2-9 the GPUs; ast's card0."""
    s = SysRoot(root)
    s.add_bridge("0000:02:00.0", domain_root="pci0000:00", iommu_group=1, vendor=mach.ASPEED,
                 device="0x1150")
    s.add_function("0000:03:00.0", parent="0000:02:00.0", vendor=mach.ASPEED, device="0x2000",
                   klass="0x030000", driver="ast", iommu_group=1, subsystem_vendor=mach.ASPEED)
    s.set_attr("0000:03:00.0", "boot_vga", "1\n")
    s.add_drm("card0", "0000:03:00.0")
    s.add_kfd_node(0, 0, cpu_cores_count=96)
    s.add_kfd_node(1, 0, cpu_cores_count=96, cpu_core_id_base=96)
    xcp = 0
    for i, bus in enumerate(mach.MI300X_BUSES):
        port, addr = f"0000:{bus - 1:02x}:00.0", f"0000:{bus:02x}:00.0"
        s.add_bridge(port, domain_root=f"pci0000:{bus - 5:02x}", iommu_group=40 + i)
        s.add_function(addr, parent=port, vendor=mach.AMD, device="0x74a1",
                       klass=mach.ACCELERATOR_CLASS,
                       driver="amdgpu", iommu_group=i + 2, subsystem_vendor=mach.AMD,
                       subsystem_device="0x74a1")
        s.add_drm(f"card{1 + 8 * i}", addr)
        s.add_drm(f"renderD{128 + 8 * i}", addr)
        for p in range(1, 8):
            mach._add_xcp_drm(s, xcp, (f"card{1 + 8 * i + p}", f"renderD{128 + 8 * i + p}"))
            xcp += 1
        s.add_kfd_node(2 + i, 90402, vendor_id=0x1002, device_id=0x74A1, location_id=bus << 8,
                       drm_render_minor=128 + 8 * i, num_xcc=8)
    s.add_dev_node("/dev/kfd")
    for name in ("amdgpu", "amdxcp", "ast"):
        s.add_module(name)
    mach._add_amd_iommu(s, "ivhd0", "0000:00:00.2", "pci0000:00")
    return s

def cloud_vm_simpledrm(root: Path, *, nvidia_drm: bool = True) -> SysRoot:
    """A cloud VM: the stdvga unbound, simpledrm's card0 on the firmware's framebuffer (a
    platform device), a T4 on nvidia with (or without) nvidia-drm's nodes; no vIOMMU."""
    s = SysRoot(root)
    s.add_function("0000:00:00.0", vendor="0x8086", device="0x1237", klass="0x060000",
                   subsystem_vendor="0x1af4", subsystem_device="0x1100")
    s.add_function("0000:00:01.0", vendor="0x1234", device="0x1111", klass="0x030000",
                   subsystem_vendor="0x1af4", subsystem_device="0x1100")
    s.set_attr("0000:00:01.0", "boot_vga", "1\n")
    base = s.root / "sys/devices/platform/simple-framebuffer.0"
    base.mkdir(parents=True)
    (base / "uevent").write_text(
        "DRIVER=simple-framebuffer\nMODALIAS=platform:simple-framebuffer\n")
    (base / "modalias").write_text("platform:simple-framebuffer\n")
    mach._drm_minor(s, base, "card0", "../../../simple-framebuffer.0")
    s.add_function("0000:00:04.0", vendor=mach.NVIDIA, device="0x1eb8", klass="0x030200",
                   driver="nvidia", subsystem_device="0x12a2")
    if nvidia_drm:
        s.add_drm("card1", "0000:00:04.0")
        s.add_drm("renderD128", "0000:00:04.0")
    for n in ("nvidia", "nvidia_uvm", "nvidia_modeset") + (("nvidia_drm",) if nvidia_drm else ()):
        s.add_module(n)
    s.add_dev_node("/dev/nvidia0")
    s.add_dev_node("/dev/nvidiactl")
    s.add_cdi_spec("etc")
    s.set_cpuinfo(mach.x86_cpuinfo(hypervisor=True))
    s.set_dmi("Amazon EC2", "g4dn.xlarge")
    return s

def q35_viommu_passthrough(root: Path) -> SysRoot:
    """A q35 guest with intel-iommu: virtio-gpu's card0/renderD128 under ``virtio0``, an
    RTX 4090 and its audio passed through behind a root port (card1/renderD129)."""
    s = SysRoot(root)
    s.add_function("0000:00:00.0", vendor="0x8086", device="0x29c0", klass="0x060000",
                   iommu_group=0, subsystem_vendor="0x1af4", subsystem_device="0x1100")
    s.add_function("0000:00:01.0", vendor="0x1af4", device="0x1050", klass="0x030000",
                   driver="virtio-pci", iommu_group=1, subsystem_vendor="0x1af4",
                   subsystem_device="0x1100")
    s.set_attr("0000:00:01.0", "boot_vga", "1\n")
    mach._add_virtio_device(s, "0000:00:01.0", 0, "virtio_gpu", 16, ("card0", "renderD128"))
    s.add_bridge("0000:00:1c.0", vendor="0x1b36", device="0x000c", iommu_group=2)
    s.add_function("0000:01:00.0", parent="0000:00:1c.0", vendor=mach.NVIDIA, device="0x2684",
                   klass="0x030000", driver="nvidia", iommu_group=3, subsystem_device="0x16f1")
    s.add_function("0000:01:00.1", parent="0000:00:1c.0", vendor=mach.NVIDIA, device="0x22ba",
                   klass="0x040300", driver="snd_hda_intel", iommu_group=3)
    s.add_drm("card1", "0000:01:00.0")
    s.add_drm("renderD129", "0000:01:00.0")
    for n in ("nvidia", "nvidia_drm", "virtio_gpu", "snd_hda_intel"):
        s.add_module(n)
    s.add_dev_node("/dev/nvidia0")
    s.add_dev_node("/dev/nvidiactl")
    s.add_cdi_spec("var")
    s.add_iommu_unit("dmar0")
    s.set_cpuinfo(mach.x86_cpuinfo(hypervisor=True))
    s.set_dmi("QEMU", "Standard PC (Q35 + ICH9, 2009)")
    s.set_cmdline("BOOT_IMAGE=/vmlinuz ro intel_iommu=on")
    return s

def apu_plus_nvidia(root: Path) -> SysRoot:
    """A Phoenix APU (amdgpu, gfx 110003, card0/renderD128: amdgpu loads first) and an
    RTX 4090 dGPU (nvidia, card1/renderD129)."""
    s = SysRoot(root)
    s.add_bridge("0000:00:01.1", iommu_group=2, vendor=mach.AMD_CPU, device="0x14ed")
    s.add_function("0000:01:00.0", parent="0000:00:01.1", vendor=mach.NVIDIA, device="0x2684",
                   driver="nvidia", iommu_group=12)
    s.add_function("0000:01:00.1", parent="0000:00:01.1", vendor=mach.NVIDIA, device="0x22ba",
                   klass="0x040300", driver="snd_hda_intel", iommu_group=12)
    s.add_bridge("0000:00:08.1", iommu_group=13, vendor=mach.AMD_CPU, device="0x14eb")
    s.add_function("0000:c5:00.0", parent="0000:00:08.1", vendor=mach.AMD, device="0x15bf",
                   driver="amdgpu", iommu_group=14, subsystem_vendor="0x1043")
    s.set_attr("0000:c5:00.0", "boot_vga", "1\n")
    for name, addr in (("card0", "0000:c5:00.0"), ("renderD128", "0000:c5:00.0"),
                       ("card1", "0000:01:00.0"), ("renderD129", "0000:01:00.0")):
        s.add_drm(name, addr)
    s.add_kfd_node(0, 0)
    s.add_kfd_node(1, 110003, vendor_id=0x1002, device_id=0x15BF, drm_render_minor=128)
    for node in ("/dev/kfd", "/dev/nvidia0", "/dev/nvidiactl"):
        s.add_dev_node(node)
    for name in ("amdgpu", "nvidia", "nvidia_drm"):
        s.add_module(name)
    s.add_cdi_spec("etc")
    mach._add_amd_iommu(s)
    return s

def gh200(root: Path) -> SysRoot:
    """A GH200 server (arm64, ACPI, SMMUv3): ast behind its bridge in domain 8, the
    Hopper function 0009:01:00.0 on nvidia with card1/renderD128, a ConnectX-7."""
    s = SysRoot(root)
    s.add_iommu_unit("smmu3.0x0000000016000000", at="arm-smmu-v3.0.auto")
    s.add_iommu_unit("smmu3.0x0000000022000000", at="arm-smmu-v3.1.auto")
    s.add_bridge("0008:00:00.0", domain_root="pci0008:00", iommu_group=3, vendor="0x10de",
                 device="0x22b8")
    s.add_bridge("0008:01:00.0", parent="0008:00:00.0", iommu_group=4, vendor=mach.ASPEED,
                 device="0x1150")
    s.add_function("0008:02:00.0", parent="0008:01:00.0", vendor=mach.ASPEED, device="0x2000",
                   klass="0x030000",
                   driver="ast", iommu_group=4, subsystem_vendor=mach.ASPEED)
    s.set_attr("0008:02:00.0", "boot_vga", "1\n")
    s.add_drm("card0", "0008:02:00.0")
    s.add_bridge("0009:00:00.0", domain_root="pci0009:00", iommu_group=18, vendor="0x10de",
                 device="0x22b2")
    s.add_function("0009:01:00.0", parent="0009:00:00.0", vendor="0x10de", device="0x2342",
                   klass="0x030200",
                   driver="nvidia", iommu_group=19, subsystem_device="0x16eb")
    s.add_drm("card1", "0009:01:00.0")
    s.add_drm("renderD128", "0009:01:00.0")
    s.add_bridge("0000:00:00.0", domain_root="pci0000:00", iommu_group=1, vendor="0x10de",
                 device="0x22b2")
    s.add_function("0000:01:00.0", parent="0000:00:00.0", vendor="0x15b3", device="0x1021",
                   klass="0x020000",
                   driver="mlx5_core", iommu_group=2, subsystem_vendor="0x15b3")
    for n in ("nvidia", "nvidia_drm", "nvidia_uvm", "nvidia_modeset", "ast", "mlx5_core"):
        s.add_module(n)
    for d in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-caps/nvidia-cap1"):
        s.add_dev_node(d)
    s.add_cdi_spec("var")
    s.set_cpuinfo(mach.ARM64_CPUINFO.replace("0xd0c", "0xd4f"))
    s.set_dmi("Supermicro", "ARS-111GL-NHR")
    s.set_cmdline("BOOT_IMAGE=/boot/vmlinuz-6.8.0-1013-nvidia-64k root=UUID=1 ro "
                  "iommu.passthrough=1")
    return s



MACHINES: dict[str, Callable[[Path], SysRoot]] = {
    "dgx": dgx_h100,
    "dgx-nvswitch-unbound": lambda r: dgx_h100(r, nvswitch_driver=""),
    "mi300x-spx": mi300x_spx_ast,
    "cloud-simpledrm": cloud_vm_simpledrm,
    "cloud-no-nvidia-drm": lambda r: cloud_vm_simpledrm(r, nvidia_drm=False),
    "q35-viommu": q35_viommu_passthrough,
    "apu-nvidia": apu_plus_nvidia,
    "gh200": gh200,
}

H100S = [f"0000:{0x19 + 0x20 * i:02x}:00.0" for i in range(8)]
#: What each machine's kernel says, probe by probe: (detect-gpu, detect-amd-gpu,
#: amd-gfx-version, amd-gfx-target, render_node, iommu_enabled, iommu_kind, the GPUs
#: detect-vfio lists with their drivers).
EXPECTED: dict[str, tuple[Any, ...]] = {
    # ast has no render node: renderD128 is the first H100's.
    "dgx": (True, False, "", "", "/dev/dri/renderD128", True, "intel",
            [("0000:03:00.0", "ast"), *((a, "nvidia") for a in H100S)]),
    "dgx-nvswitch-unbound": (True, False, "", "", "/dev/dri/renderD128", True, "intel",
                             [("0000:03:00.0", "ast"), *((a, "nvidia") for a in H100S)]),
    # MI300X is a Processing accelerator (0x1200): no GPU of detect-vfio's; its card is
    # amdgpu's all the same, and KFD's first GPU node names gfx942.
    "mi300x-spx": (False, True, "9.4.0", "gfx942", "/dev/dri/renderD128", True, "amd",
                   [("0000:03:00.0", "ast")]),
    "cloud-simpledrm": (True, False, "", "", "/dev/dri/renderD128", False, "",
                        [("0000:00:01.0", ""), ("0000:00:04.0", "nvidia")]),
    "cloud-no-nvidia-drm": (True, False, "", "", "", False, "",
                            [("0000:00:01.0", ""), ("0000:00:04.0", "nvidia")]),
    # virtio-gpu's renderD128 (0x1af4) loses to the NVIDIA card's renderD129.
    "q35-viommu": (True, False, "", "", "/dev/dri/renderD129", True, "intel",
                   [("0000:00:01.0", "virtio-pci"), ("0000:01:00.0", "nvidia")]),
    # Both vendors are GPU vendors: the first render node, the APU's, is the answer.
    "apu-nvidia": (True, True, "11.0.0", "gfx1103", "/dev/dri/renderD128", True, "amd",
                   [("0000:01:00.0", "nvidia"), ("0000:c5:00.0", "amdgpu")]),
    "gh200": (True, False, "", "", "/dev/dri/renderD128", True, "arm",
              [("0008:02:00.0", "ast"), ("0009:01:00.0", "nvidia")]),
}


def _drop_links(root: Path, names: set[str]) -> None:
    for link in [p for p in (root / "sys").rglob("*") if p.is_symlink() and p.name in names]:
        link.unlink()


COPIES: dict[str, Callable[[SysRoot], object]] = {
    "live": lambda s: None,
    "tar": lambda s: (s.capture(), s.pad_like_tar()),
    "links-left-out": lambda s: _drop_links(s.root, {"driver", "iommu_group", "device"}),
}


def summary(root: Path) -> tuple[Any, ...]:
    model = gpuwatch.scan(root)
    hd = model.probe("detect-host-devices")
    vfio = model.probe("detect-vfio")
    return (model.probe("detect-gpu"), model.probe("detect-amd-gpu"),
            model.probe("amd-gfx-version"), model.probe("amd-gfx-target"), hd.render_node,
            vfio.iommu_enabled, vfio.iommu_kind, [(g.addr, g.driver) for g in vfio.gpus])


@pytest.mark.parametrize("copy", sorted(COPIES))
@pytest.mark.parametrize("kind", sorted(MACHINES))
def test_each_machine_answers_as_its_kernel_says(tmp_path: Path, kind: str, copy: str) -> None:
    s = MACHINES[kind](tmp_path / "h")
    COPIES[copy](s)
    assert summary(s.root) == EXPECTED[kind]


@pytest.mark.parametrize("kind", sorted(MACHINES))
def test_the_cold_cli_probe_answers_as_the_model(tmp_path: Path, kind: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The direct ``gpuwatch probe`` reads only what an answer reports (`FreshHost`): the
    same answers as the model on every one of these machines."""
    s = MACHINES[kind](tmp_path / "h")
    model = gpuwatch.scan(s.root)
    for action in ("detect-vfio", "detect-gpu", "detect-amd-gpu", "amd-gfx-version",
                   "amd-gfx-target", "detect-host-devices"):
        code, out, err = run_main(capsys, "probe", action, "--root", str(s.root))
        assert (code, err) == (0, ""), action
        assert json.loads(out)["result"] == jsonable(model.probe(action)), action
    assert os.path.isdir(s.root / "sys/class/drm")
