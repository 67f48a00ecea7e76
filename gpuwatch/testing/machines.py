"""Hosts of the kinds gpuwatch meets in the field, laid out as those machines lay out sysfs.

Each builder returns a `SysRoot` modelled on a real machine of that kind: the vendor and
device ids, classes, drivers, IOMMU grouping and KFD topology such a host shows. Call
``SysRoot.capture()`` on the result for the tree a capture tool would copy from it.
"""

from __future__ import annotations

import os
from pathlib import Path

from gpuwatch.testing.sysroot import SysRoot

NVIDIA, AMD, INTEL, ASPEED, MATROX, HPE = "0x10de", "0x1002", "0x8086", "0x1a03", "0x102b", "0x103c"
#: AMD's CPU side (its IOMMU, host bridges); ``AMD`` above is the GPUs' vendor id (ATI's).
AMD_CPU = "0x1022"

#: The first stanza of an arm64 server's ``proc/cpuinfo`` (an Ampere Altra's Neoverse N1).
ARM64_CPUINFO = (
    "processor\t: 0\nBogoMIPS\t: 50.00\n"
    "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid "
    "asimdrdm lrcpc dcpop asimddp ssbs\n"
    "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\n"
    "CPU part\t: 0xd0c\nCPU revision\t: 1\n\n"
)


def x86_cpuinfo(*, hypervisor: bool = False, cpus: int = 2) -> str:
    """An x86 host's ``proc/cpuinfo``, ``cpus`` stanzas; ``hypervisor``: the flag every
    hypervisor sets in its guests' CPUID (a guest's)."""
    flags = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush "
             "mmx fxsr sse sse2 ss ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl "
             "xtopology cpuid tsc_known_freq pni pclmulqdq vmx ssse3 fma cx16 pcid sse4_1 sse4_2 "
             "x2apic movbe popcnt aes xsave avx f16c rdrand")
    if hypervisor:
        flags += " hypervisor"
    flags += " lahf_lm abm 3dnowprefetch arat avx512f"
    return "".join(
        f"processor\t: {i}\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
        f"model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: {flags}\n\n"
        for i in range(cpus))


def _add_amd_iommu(s: SysRoot, unit: str = "ivhd0", addr: str = "0000:00:00.2",
                   root: str = "pci0000:00") -> None:
    """An AMD IOMMU as the kernel registers it: its own PCI function (``0x1022:0x1481``, class
    0x0806, no driver, no group) on a root bus, and its unit below it (``…/iommu/ivhd0``)."""
    s.add_function(addr, parent=root, vendor=AMD_CPU, device="0x1481", klass="0x080600",
                   subsystem_vendor=AMD_CPU)
    s.add_iommu_unit(unit, at=addr)


def bmc_server_host(root: str | os.PathLike[str]) -> SysRoot:
    """A 2U GPU server: the BMC's ASPEED AST2600 VGA (``ast``, boot_vga 1) behind the BMC's
    own bridge in IOMMU group 20, and two NVIDIA A100s (3D controllers, no audio) on nvidia
    in groups 30 and 31. The ASPEED is the host's console: never a passthrough candidate."""
    s = SysRoot(root)
    s.add_bridge("0000:00:1c.0", iommu_group=10)
    s.add_bridge("0000:02:00.0", parent="0000:00:1c.0", vendor=ASPEED, device="0x1150",
                 iommu_group=20)
    s.add_function("0000:03:00.0", parent="0000:02:00.0", vendor=ASPEED, device="0x2000",
                   klass="0x030000", driver="ast", iommu_group=20, subsystem_vendor=ASPEED)
    s.set_attr("0000:03:00.0", "boot_vga", "1\n")
    s.add_drm("card0", "0000:03:00.0")
    for i, (port, addr) in enumerate((("0000:40:01.1", "0000:41:00.0"),
                                      ("0000:c0:01.1", "0000:c1:00.0"))):
        s.add_bridge(port, domain_root=f"pci0000:{port[5:7]}", iommu_group=40 + i)
        s.add_function(addr, parent=port, vendor=NVIDIA, device="0x20b2", klass="0x030200",
                       driver="nvidia", iommu_group=30 + i)
        s.add_dev_node(f"/dev/nvidia{i}")
    s.add_module("nvidia", refcnt=2, holders=("nvidia_modeset", "nvidia_uvm"))
    s.add_module("nvidia_modeset", refcnt=1, holders=("nvidia_drm",))
    s.add_module("nvidia_drm")
    s.add_module("nvidia_uvm")
    s.add_module("ast")
    s.add_dev_node("/dev/nvidiactl")
    s.add_cdi_spec("etc")
    _add_amd_iommu(s)
    return s


def hpe_ilo_host(root: str | os.PathLike[str]) -> SysRoot:
    """An HPE ProLiant: the iLO's functions share slot 01:00 and one IOMMU group (1): the
    management processor (``hpilo``), its watchdog (``hpwdt``) and the Matrox G200eH3 VGA
    (``mgag200``, boot_vga 1), plus one NVIDIA L4 on nvidia in group 40."""
    s = SysRoot(root)
    s.add_bridge("0000:00:1c.4", iommu_group=9)
    ilo = (("0000:01:00.0", HPE, "0x3306", "0x088000", "hpwdt"),
           ("0000:01:00.1", MATROX, "0x0538", "0x030000", "mgag200"),
           ("0000:01:00.2", HPE, "0x3307", "0x088000", "hpilo"))
    for addr, vendor, device, klass, driver in ilo:
        s.add_function(addr, parent="0000:00:1c.4", vendor=vendor, device=device, klass=klass,
                       driver=driver, iommu_group=1, subsystem_vendor=HPE)
    s.set_attr("0000:01:00.1", "boot_vga", "1\n")
    s.add_bridge("0000:00:03.0", iommu_group=39)
    s.add_function("0000:08:00.0", parent="0000:00:03.0", vendor=NVIDIA, device="0x27b8",
                   klass="0x030200", driver="nvidia", iommu_group=40)
    s.add_module("nvidia")
    s.add_iommu_unit("dmar0")
    return s


def vmd_host(root: str | os.PathLike[str], *, shared: bool = False) -> SysRoot:
    """An Intel workstation with VMD on: the VMD controller (0000:00:0e.0, ``vmd``) opens PCI
    domain 10000, where an NVMe drive and an NVIDIA RTX A4000 with its HDMI audio sit
    (``10000:01:00.0``/``.1``, one IOMMU group: VMD's own). ``shared``: the A4000 and its
    audio in the controller's group 5 too, beside the NVMe drive, as DMA from behind VMD
    carries the controller's requester id: one group whose addresses are of two widths."""
    s = SysRoot(root)
    gpu_group = 5 if shared else 6
    s.add_function("0000:00:02.0", vendor=INTEL, device="0xa780", klass="0x030000",
                   driver="i915", iommu_group=0, subsystem_vendor=INTEL)
    s.set_attr("0000:00:02.0", "boot_vga", "1\n")
    s.add_function("0000:00:0e.0", vendor=INTEL, device="0xa77f", klass="0x010400",
                   driver="vmd", iommu_group=5, subsystem_vendor=INTEL)
    domain = s.add_vmd_domain("0000:00:0e.0", "10000")
    s.add_bridge("10000:00:01.0", parent=domain, iommu_group=5)
    s.add_function("10000:01:00.0", parent="10000:00:01.0", vendor=NVIDIA, device="0x24b0",
                   klass="0x030000", driver="nvidia" if shared else "vfio-pci",
                   iommu_group=gpu_group)
    s.add_function("10000:01:00.1", parent="10000:00:01.0", vendor=NVIDIA, device="0x228b",
                   klass="0x040300", driver="snd_hda_intel" if shared else "vfio-pci",
                   iommu_group=gpu_group)
    s.add_function("10000:02:00.0", parent="10000:00:01.0", vendor="0x144d", device="0xa80a",
                   klass="0x010802", driver="nvme", iommu_group=5)
    if not shared:
        s.add_vfio_group(6)
    s.add_module("vfio_pci")
    s.add_iommu_unit("dmar0")
    return s


def instinct_host(root: str | os.PathLike[str], *, gfx: int = 90010, device: str = "0x740f",
                  cards: int = 2) -> SysRoot:
    """An AMD Instinct node: ``cards`` OAM/PCIe accelerators (Display controller 0x0380, on
    amdgpu; MI210 ``0x740f`` gfx_target_version 90010 by default, MI300X ``0x74a1`` 90402),
    KFD node 0 the CPU, nodes 1… the GPUs, as kfd_topology numbers them."""
    s = SysRoot(root)
    s.add_kfd_node(0, 0)
    for i in range(cards):
        port, addr = f"0000:{0x10 * (i + 1):02x}:01.0", f"0000:{0x10 * (i + 1) + 1:02x}:00.0"
        s.add_bridge(port, iommu_group=50 + i)
        s.add_function(addr, parent=port, vendor=AMD, device=device, klass="0x038000",
                       driver="amdgpu", iommu_group=60 + i, subsystem_vendor=AMD)
        s.add_drm(f"card{i + 1}", addr)
        s.add_drm(f"renderD{128 + i}", addr)
        s.add_kfd_node(i + 1, gfx, vendor_id=int(AMD, 16), device_id=int(device, 16),
                       drm_render_minor=128 + i)
    s.add_dev_node("/dev/kfd")
    s.add_module("amdgpu")
    _add_amd_iommu(s)
    return s


def vm_guest_host(root: str | os.PathLike[str]) -> SysRoot:
    """A cloud VM: virtio-gpu console (boot_vga 1) and a passed-through NVIDIA T4 on nvidia,
    no vIOMMU (so no IOMMU groups at all)."""
    s = SysRoot(root)
    s.add_function("0000:00:01.0", vendor="0x1af4", device="0x1050", klass="0x030000",
                   driver="virtio-pci", subsystem_vendor="0x1af4")
    s.set_attr("0000:00:01.0", "boot_vga", "1\n")
    s.add_function("0000:00:05.0", vendor=NVIDIA, device="0x1eb8", klass="0x030200",
                   driver="nvidia")
    s.add_drm("card0", "0000:00:01.0")
    s.add_module("nvidia")
    s.add_dev_node("/dev/nvidia0")
    s.add_cdi_spec("var")
    return s


def single_gpu_desktop(root: str | os.PathLike[str], *, boot_vga: bool = True) -> SysRoot:
    """A desktop whose only display function is an NVIDIA RTX 3080 (+ HDMI audio, group 12):
    the firmware booted on it, so it is the host's console (boot_vga 1)."""
    s = SysRoot(root)
    s.add_bridge("0000:00:01.0", iommu_group=2)
    s.add_function("0000:01:00.0", parent="0000:00:01.0", device="0x2206", driver="nvidia",
                   iommu_group=12)
    s.add_function("0000:01:00.1", parent="0000:00:01.0", device="0x1aef", klass="0x040300",
                   driver="snd_hda_intel", iommu_group=12)
    if boot_vga:
        s.set_attr("0000:01:00.0", "boot_vga", "1\n")
    s.add_drm("card0", "0000:01:00.0")
    s.add_module("nvidia", refcnt=2, holders=("nvidia_modeset", "nvidia_uvm"))
    s.add_module("nvidia_modeset", refcnt=1, holders=("nvidia_drm",))
    s.add_module("nvidia_drm")
    s.add_module("nvidia_uvm")
    s.add_module("snd_hda_intel")
    s.add_dev_node("/dev/nvidia0")
    s.add_dev_node("/dev/nvidiactl")
    s.add_cdi_spec("etc")
    s.add_iommu_unit("dmar0")
    return s


def _add_console_igpu(s: SysRoot, device: str, *, subsystem_vendor: str) -> None:
    """The Intel iGPU the firmware booted on, where every Intel client chipset puts it
    (0000:00:02.0, ``i915``, boot_vga 1, card0/renderD128), alone in IOMMU group 0."""
    s.add_function("0000:00:02.0", vendor=INTEL, device=device, klass="0x030000",
                   driver="i915", iommu_group=0, subsystem_vendor=subsystem_vendor)
    s.set_attr("0000:00:02.0", "boot_vga", "1\n")
    s.add_drm("card0", "0000:00:02.0")
    s.add_drm("renderD128", "0000:00:02.0")


def turing_desktop_host(root: str | os.PathLike[str]) -> SysRoot:
    """A consumer Intel desktop (Coffee Lake) with an RTX 2080 in the CPU's x16 slot, as such
    a host lays out: the CPU root port 0000:00:01.0 has no ACS, so it shares IOMMU group 1 with
    the four functions of the card, VGA (``nvidia``), HDMI audio (``snd_hda_intel``), the
    VirtualLink USB-C controller (``xhci_hcd``) and its UCSI controller (serial bus class
    0x0c80, ``nvidia-gpu``); the iGPU (``i915``, boot_vga 1) alone in group 0."""
    s = SysRoot(root)
    _add_console_igpu(s, "0x3e92", subsystem_vendor="0x1043")
    s.add_bridge("0000:00:01.0", iommu_group=1, vendor=INTEL, device="0x1901")
    card = (("0000:01:00.0", "0x1e87", "0x030000", "nvidia"),
            ("0000:01:00.1", "0x10f8", "0x040300", "snd_hda_intel"),
            ("0000:01:00.2", "0x1ad8", "0x0c0330", "xhci_hcd"),
            ("0000:01:00.3", "0x1ad9", "0x0c8000", "nvidia-gpu"))
    for addr, device, klass, driver in card:
        s.add_function(addr, parent="0000:00:01.0", vendor=NVIDIA, device=device, klass=klass,
                       driver=driver, iommu_group=1, subsystem_vendor="0x1043",
                       subsystem_device="0x8668")
    s.add_drm("card1", "0000:01:00.0")
    s.add_drm("renderD129", "0000:01:00.0")
    s.add_bridge("0000:00:1c.0", iommu_group=5, vendor=INTEL, device="0xa338")
    s.add_function("0000:02:00.0", parent="0000:00:1c.0", vendor="0x144d", device="0xa808",
                   klass="0x010802", driver="nvme", iommu_group=6)
    for name in ("nvidia", "nvidia_modeset", "nvidia_drm", "nvidia_uvm", "i915",
                 "snd_hda_intel", "i2c_nvidia_gpu"):
        s.add_module(name)
    s.add_dev_node("/dev/nvidia0")
    s.add_dev_node("/dev/nvidiactl")
    s.add_cdi_spec("etc")
    s.add_iommu_unit("dmar0")
    s.add_iommu_unit("dmar1")
    s.set_cmdline("BOOT_IMAGE=/boot/vmlinuz-6.8.0-45-generic root=UUID=1c2e ro quiet splash "
                  "intel_iommu=on iommu=pt")
    return s


#: PCI buses of the eight MI300X of an 8-GPU node, from a real KFD topology capture
#: (``location_id`` ``bus << 8 | devfn``: 0x0500, 0x2700, 0x4700, …).
MI300X_BUSES = (0x05, 0x27, 0x47, 0x65, 0x85, 0xa7, 0xc7, 0xe5)
#: ``Processing accelerators`` (0x1200): the class an MI300X reports, as ``lspci -nn`` shows
#: it (``Processing accelerators [1200]: … Aqua Vanjaram [Instinct MI300X] [1002:74a1]``).
ACCELERATOR_CLASS = "0x120000"


def mi300x_cpx_host(root: str | os.PathLike[str], *, partitions: int = 8) -> SysRoot:
    """An 8-GPU MI300X node (``0x1002:0x74a1``, class 0x1200, on amdgpu, each alone in its IOMMU
    group behind its own root port), dual-socket, in the CPX compute partition mode: as a real
    KFD topology of such a node reads, nodes 0 and 1 are the CPUs (``gfx_target_version 0``)
    and every GPU shows ``partitions`` nodes (2…65: node 10 after node 9), all
    ``gfx_target_version 90402``, ``location_id`` the GPU's bus and the partition's number,
    ``drm_render_minor`` 128… one each.

    Only the first partition's DRM nodes (``card<8i>``, ``renderD<128+8i>``) are the PCI
    function's; amdgpu registers the others on platform devices of its own,
    ``/sys/devices/platform/amdgpu_xcp.<N>``, which have no ``vendor`` and no driver."""
    s = SysRoot(root)
    s.add_kfd_node(0, 0, cpu_cores_count=96)
    s.add_kfd_node(1, 0, cpu_cores_count=96, cpu_core_id_base=96)
    node, xcp = 2, 0
    for i, bus in enumerate(MI300X_BUSES):
        port, addr = f"0000:{bus - 1:02x}:00.0", f"0000:{bus:02x}:00.0"
        s.add_bridge(port, domain_root=f"pci0000:{bus - 5:02x}", iommu_group=40 + i)
        s.add_function(addr, parent=port, vendor=AMD, device="0x74a1", klass=ACCELERATOR_CLASS,
                       driver="amdgpu", iommu_group=i, subsystem_vendor=AMD,
                       subsystem_device="0x74a1")
        first = partitions * i
        s.add_drm(f"card{first}", addr)
        s.add_drm(f"renderD{128 + first}", addr)
        for p in range(partitions):
            s.add_kfd_node(node, 90402, vendor_id=int(AMD, 16), device_id=0x74A1,
                           location_id=bus << 8 | p, domain=0, drm_render_minor=128 + first + p,
                           num_xcc=1)
            node += 1
            if p:
                _add_xcp_drm(s, xcp, (f"card{first + p}", f"renderD{128 + first + p}"))
                xcp += 1
    s.add_dev_node("/dev/kfd")
    s.add_module("amdgpu")
    s.add_module("amdxcp")
    _add_amd_iommu(s, "ivhd0", "0000:00:00.2", "pci0000:00")
    _add_amd_iommu(s, "ivhd1", "0000:80:00.2", "pci0000:80")
    return s


def _add_xcp_drm(s: SysRoot, index: int, names: tuple[str, ...]) -> None:
    """DRM minors on amdgpu's partition platform device ``amdgpu_xcp.<index>``, laid out as
    the kernel lays out a platform device's: ``device`` leads to it, no vendor, no driver."""
    platform = f"sys/devices/platform/amdgpu_xcp.{index}"
    base = s.root / platform
    base.mkdir(parents=True)
    (base / "uevent").write_text("MODALIAS=platform:amdgpu_xcp\n")
    (base / "modalias").write_text("platform:amdgpu_xcp\n")
    for name in names:
        _drm_minor(s, base, name, f"../../../amdgpu_xcp.{index}")


#: NVIDIA HGX H100 parts, as ``lspci -nnk`` shows them on such a board: the SXM5 GPU (3D
#: controller), the third-generation NVSwitch (``Bridge [0680]``, driver ``nvidia-nvswitch``)
#: and the Broadcom PEX89xxx switch each GPU sits behind.
H100_SXM, NVSWITCH, BROADCOM, PEX89000 = "0x2330", "0x22a3", "0x1000", "0xc030"
#: ``Bridge: other`` (0x0680): the class NVSwitches report.
OTHER_BRIDGE_CLASS = "0x068000"


def hgx_h100_host(root: str | os.PathLike[str], *, gpus: int = 8, acs: bool = True) -> SysRoot:
    """An 8-GPU HGX H100 node: each SXM5 GPU (``0x10de:0x2330``, 3D controller, ``nvidia``)
    behind a downstream port of a Broadcom PEX89xxx switch, beside a ConnectX-7 NIC
    (``mlx5_core``); four NVSwitches (``0x10de:0x22a3``, class 0x0680, bound to
    ``nvidia-nvswitch``, the PCI driver nvidia.ko registers for them) on their own ports; the
    BMC's ASPEED VGA (``ast``, boot_vga 1). With ``acs`` every endpoint and port is alone in
    its IOMMU group; without it (HGX boards turn ACS off on the PCIe switches for GPUDirect
    RDMA, so the GPU and the NIC talk peer to peer) the kernel puts the switch's upstream
    and downstream ports, the GPU and the NIC behind it in one group."""
    s = SysRoot(root)
    s.add_bridge("0000:02:00.0", domain_root="pci0000:00", iommu_group=1, vendor=ASPEED,
                 device="0x1150")
    s.add_function("0000:03:00.0", parent="0000:02:00.0", vendor=ASPEED, device="0x2000",
                   klass="0x030000", driver="ast", iommu_group=1, subsystem_vendor=ASPEED)
    s.set_attr("0000:03:00.0", "boot_vga", "1\n")
    s.add_drm("card0", "0000:03:00.0", dev_node=True)
    group = 10
    for i in range(gpus):
        bus = 0x18 + 0x20 * i
        root_port, up, down_gpu, down_nic = (f"0000:{bus - 2:02x}:01.0", f"0000:{bus - 1:02x}:00.0",
                                             f"0000:{bus:02x}:00.0", f"0000:{bus:02x}:01.0")
        # With ACS: each in a group of its own; without: all in the upstream port's.
        up_group, down_gpu_group, down_nic_group, gpu_group, nic_group = (
            (group + 1, group + 3, group + 4, group + 2, group + 5) if acs
            else (group + 1,) * 5)
        s.add_bridge(root_port, domain_root=f"pci0000:{bus - 2:02x}", iommu_group=group)
        s.add_bridge(up, parent=root_port, vendor=BROADCOM, device=PEX89000,
                     iommu_group=up_group)
        s.add_bridge(down_gpu, parent=up, vendor=BROADCOM, device=PEX89000,
                     iommu_group=down_gpu_group)
        s.add_bridge(down_nic, parent=up, vendor=BROADCOM, device=PEX89000,
                     iommu_group=down_nic_group)
        s.add_function(f"0000:{bus + 1:02x}:00.0", parent=down_gpu, vendor=NVIDIA,
                       device=H100_SXM, klass="0x030200", driver="nvidia",
                       iommu_group=gpu_group, subsystem_device="0x16c1")
        s.add_function(f"0000:{bus + 2:02x}:00.0", parent=down_nic, vendor="0x15b3",
                       device="0x1021", klass="0x020700", driver="mlx5_core",
                       iommu_group=nic_group, subsystem_vendor="0x15b3")
        s.add_dev_node(f"/dev/nvidia{i}")
        group += 6
    for j in range(4):
        port, addr = f"0000:{0xe0 + 2 * j:02x}:00.0", f"0000:{0xe1 + 2 * j:02x}:00.0"
        s.add_bridge(port, domain_root=f"pci0000:{0xe0 + 2 * j:02x}", iommu_group=group)
        s.add_function(addr, parent=port, vendor=NVIDIA, device=NVSWITCH,
                       klass=OTHER_BRIDGE_CLASS, driver="nvidia-nvswitch",
                       iommu_group=group + 1, subsystem_device="0x1796")
        s.add_dev_node(f"/dev/nvidia-nvswitch{j}")
        group += 2
    s.add_dev_node("/dev/nvidia-nvswitchctl")
    s.add_dev_node("/dev/nvidiactl")
    s.add_module("nvidia", refcnt=3, holders=("nvidia_modeset", "nvidia_uvm", "nvidia_peermem"))
    for name in ("nvidia_modeset", "nvidia_uvm", "nvidia_peermem", "mlx5_core", "ast"):
        s.add_module(name)
    s.add_cdi_spec("var")
    s.add_iommu_unit("dmar0")
    s.add_iommu_unit("dmar1")
    s.set_cmdline("BOOT_IMAGE=/vmlinuz-5.15.0-119-generic root=UUID=9b1f ro intel_iommu=on "
                  "iommu=pt pci=realloc=off")
    return s


def hybrid_laptop_host(root: str | os.PathLike[str], *, dgpu_class: str = "0x030200",
                       fbdev: bool = False) -> SysRoot:
    """An Optimus laptop: the Intel iGPU (``i915``, boot_vga 1, card0/renderD128) drives the
    panel; the NVIDIA dGPU (an RTX 3050 Mobile, ``0x10de:0x25a2``, a 3D controller with no
    audio function and no ``boot_vga`` file, on ``nvidia``: card1/renderD129) sits behind the
    CPU's PEG port in its own group. IOMMU on by the distribution kernel's default (no
    ``intel_iommu=`` on the command line). ``fbdev``: i915's fbdev emulation holds the
    console (``fb0``, ``i915drmfb``, under the iGPU)."""
    s = SysRoot(root)
    _add_console_igpu(s, "0x46a6", subsystem_vendor="0x17aa")
    if fbdev:
        s.add_framebuffer("fb0", "0000:00:02.0", fb_name="i915drmfb")
    s.add_bridge("0000:00:06.0", iommu_group=3, vendor=INTEL, device="0x464d")
    s.add_bridge("0000:00:01.0", iommu_group=1, vendor=INTEL, device="0x460d")
    s.add_function("0000:01:00.0", parent="0000:00:01.0", vendor=NVIDIA, device="0x25a2",
                   klass=dgpu_class, driver="nvidia", iommu_group=12,
                   subsystem_vendor="0x17aa", subsystem_device="0x3a4c")
    s.add_drm("card1", "0000:01:00.0")
    s.add_drm("renderD129", "0000:01:00.0")
    s.add_function("0000:02:00.0", parent="0000:00:06.0", vendor="0x144d", device="0xa80a",
                   klass="0x010802", driver="nvme", iommu_group=13)
    for name in ("nvidia", "nvidia_modeset", "nvidia_drm", "nvidia_uvm", "i915", "nvme"):
        s.add_module(name)
    s.add_dev_node("/dev/nvidia0")
    s.add_dev_node("/dev/nvidiactl")
    s.add_iommu_unit("dmar0")
    s.add_iommu_unit("dmar1")
    s.set_cmdline("BOOT_IMAGE=/boot/vmlinuz-6.8.0-49-generic root=UUID=4c1d ro quiet splash")
    return s


FLEX_170, FLEX_PF = "0x56c0", "0000:4d:00.0"


def intel_flex_sriov_host(root: str | os.PathLike[str], *, vfs: int = 4,
                          driver: str = "i915", vf_driver: str | None = "vfio-pci") -> SysRoot:
    """A server with an Intel Data Center GPU Flex 170 (``0x8086:0x56c0``, Display controller
    0x0380) on ``i915`` (or ``xe``), SR-IOV on (``sriov_totalvfs`` 31): ``vfs`` VFs at function
    1 on (offset 1, stride 1, same device id and class), each in its own IOMMU group, bound to
    ``vf_driver``. Only the PF has DRM nodes; an ASPEED BMC is the console."""
    s = SysRoot(root)
    s.add_bridge("0000:02:00.0", iommu_group=1, vendor=ASPEED, device="0x1150")
    s.add_function("0000:03:00.0", parent="0000:02:00.0", vendor=ASPEED, device="0x2000",
                   klass="0x030000", driver="ast", iommu_group=1, subsystem_vendor=ASPEED)
    s.set_attr("0000:03:00.0", "boot_vga", "1\n")
    s.add_drm("card0", "0000:03:00.0", dev_node=True)
    s.add_bridge("0000:4a:01.0", domain_root="pci0000:4a", iommu_group=30)
    s.add_bridge("0000:4b:00.0", parent="0000:4a:01.0", vendor=INTEL, device="0x4fa0",
                 iommu_group=31)
    s.add_bridge("0000:4c:01.0", parent="0000:4b:00.0", vendor=INTEL, device="0x4fa4",
                 iommu_group=32)
    s.add_function(FLEX_PF, parent="0000:4c:01.0", vendor=INTEL, device=FLEX_170,
                   klass="0x038000", driver=driver, iommu_group=33, subsystem_vendor=INTEL,
                   subsystem_device="0x4905")
    s.enable_sriov(FLEX_PF, 31, offset=1)
    s.add_drm("card1", FLEX_PF)
    s.add_drm("renderD128", FLEX_PF)
    s.add_vfs(FLEX_PF, vfs, driver=vf_driver, first_group=34)
    if vf_driver and "vfio" in vf_driver:
        for i in range(vfs):
            s.add_vfio_group(34 + i)
        s.add_module("vfio_pci")
    s.add_module(driver)
    s.add_module("ast")
    s.add_iommu_unit("dmar0")
    s.set_cmdline("BOOT_IMAGE=/vmlinuz-6.5.0-35-generic ro intel_iommu=on iommu=pt "
                  "i915.max_vfs=31 i915.enable_guc=3")
    return s


#: Intel Arc A770 (DG2): the GPU, its HDMI/DP audio, and the ports of the switch on the card.
ARC_A770, ARC_AUDIO, DG2_UPSTREAM, DG2_DOWNSTREAM = "0x56a0", "0x4f90", "0x4fa1", "0x4fa4"


def arc_desktop_host(root: str | os.PathLike[str], *, driver: str = "i915",
                     acs: bool = True) -> SysRoot:
    """A Raptor Lake desktop with an Intel Arc A770 (``0x8086:0x56a0``, VGA, on ``driver``:
    ``i915`` or ``xe``) as DG2 cards lay out: the card carries its own PCIe switch, upstream
    port 0000:01:00.0 behind the CPU's root port, downstream ports 0000:02:01.0 (the GPU at
    0000:03:00.0, card1/renderD129) and 0000:02:04.0 (its audio, ``0x4f90``, at 0000:04:00.0
    on ``snd_hda_intel``: another bus). With ``acs`` (as these ports report it) the GPU and its
    audio are in IOMMU groups of their own, 4 and 6; without it the downstream ports, the GPU
    and the audio share group 4. The iGPU (``i915``, boot_vga 1) keeps card0/renderD128."""
    s = SysRoot(root)
    _add_console_igpu(s, "0xa780", subsystem_vendor="0x1043")
    s.add_bridge("0000:00:01.0", iommu_group=1, vendor=INTEL, device="0xa70d")
    s.add_bridge("0000:01:00.0", parent="0000:00:01.0", vendor=INTEL, device=DG2_UPSTREAM,
                 iommu_group=2)
    s.add_bridge("0000:02:01.0", parent="0000:01:00.0", vendor=INTEL, device=DG2_DOWNSTREAM,
                 iommu_group=3 if acs else 4)
    s.add_bridge("0000:02:04.0", parent="0000:01:00.0", vendor=INTEL, device=DG2_DOWNSTREAM,
                 iommu_group=5 if acs else 4)
    s.add_function("0000:03:00.0", parent="0000:02:01.0", vendor=INTEL, device=ARC_A770,
                   klass="0x030000", driver=driver, iommu_group=4, subsystem_vendor=INTEL,
                   subsystem_device="0x1020")
    s.add_function("0000:04:00.0", parent="0000:02:04.0", vendor=INTEL, device=ARC_AUDIO,
                   klass="0x040300", driver="snd_hda_intel", iommu_group=6 if acs else 4,
                   subsystem_vendor=INTEL, subsystem_device="0x1020")
    s.add_drm("card1", "0000:03:00.0")
    s.add_drm("renderD129", "0000:03:00.0")
    for name in dict.fromkeys(("i915", driver, "snd_hda_intel")):
        s.add_module(name)
    s.add_iommu_unit("dmar0")
    s.add_iommu_unit("dmar1")
    s.set_cmdline("BOOT_IMAGE=/boot/vmlinuz-6.8.0-45-generic root=UUID=3a1f ro intel_iommu=on "
                  "iommu=pt")
    return s


IGPU = "0000:00:02.0"


def igpu_sriov_host(root: str | os.PathLike[str], *, vfs: int = 2) -> SysRoot:
    """A mini PC whose only display is its Alder Lake iGPU (``0x8086:0x46a6``, ``i915``,
    boot_vga 1), split with SR-IOV for VMs as i915's SR-IOV support does it (``sriov_totalvfs``
    7, offset 1, stride 1): ``vfs`` VFs at 0000:00:02.1… (VGA class, the PF's device id, no
    ``boot_vga`` of their own but 0), each in its own IOMMU group from 20 on, on vfio-pci.
    The PF is still the host's console: the VFs have no output."""
    s = SysRoot(root)
    _add_console_igpu(s, "0x46a6", subsystem_vendor="0x8086")
    s.enable_sriov(IGPU, 7)
    s.add_vfs(IGPU, vfs, driver="vfio-pci", first_group=20)
    for i in range(vfs):
        s.add_vfio_group(20 + i)
    for name in ("i915", "vfio", "vfio_pci"):
        s.add_module(name)
    s.add_iommu_unit("dmar0")
    s.set_cmdline("BOOT_IMAGE=/vmlinuz-6.8.0-45-generic ro intel_iommu=on iommu=pt "
                  "i915.enable_guc=3 i915.max_vfs=7")
    return s


def amd_apu_dgpu_host(root: str | os.PathLike[str]) -> SysRoot:
    """A Ryzen 9 7950X desktop: the Raphael iGPU (``0x1002:0x164e``, amdgpu, gfx 100306) and a
    Radeon RX 7900 XTX (``0x1002:0x744c``, amdgpu, gfx 110000, boot_vga 1: the firmware's
    primary display), each with its HDMI audio in its group. amdgpu probes the dGPU first
    (lower bus): card0/renderD128 and KFD node 1 are the dGPU's, card1/renderD129 and node
    2 the iGPU's; node 0 is the CPU."""
    s = SysRoot(root)
    s.add_bridge("0000:00:01.1", iommu_group=2, vendor=AMD, device="0x14db")
    s.add_bridge("0000:01:00.0", parent="0000:00:01.1", vendor=AMD, device="0x1478",
                 iommu_group=3)
    s.add_bridge("0000:02:00.0", parent="0000:01:00.0", vendor=AMD, device="0x1479",
                 iommu_group=4)
    s.add_function("0000:03:00.0", parent="0000:02:00.0", vendor=AMD, device="0x744c",
                   driver="amdgpu", iommu_group=5, subsystem_vendor="0x1da2")
    s.set_attr("0000:03:00.0", "boot_vga", "1\n")
    s.add_function("0000:03:00.1", parent="0000:02:00.0", vendor=AMD, device="0xab30",
                   klass="0x040300", driver="snd_hda_intel", iommu_group=5)
    s.add_bridge("0000:00:08.1", iommu_group=13, vendor=AMD, device="0x14dd")
    s.add_function("0000:12:00.0", parent="0000:00:08.1", vendor=AMD, device="0x164e",
                   driver="amdgpu", iommu_group=14, subsystem_vendor="0x1458")
    s.add_function("0000:12:00.1", parent="0000:00:08.1", vendor=AMD, device="0x1640",
                   klass="0x040300", driver="snd_hda_intel", iommu_group=15)
    s.add_function("0000:12:00.2", parent="0000:00:08.1", vendor=AMD, device="0x1649",
                   klass="0x108000", driver="ccp", iommu_group=16)
    for i, addr in enumerate(("0000:03:00.0", "0000:12:00.0")):
        s.add_drm(f"card{i}", addr)
        s.add_drm(f"renderD{128 + i}", addr)
    s.add_kfd_node(0, 0, cpu_cores_count=32)
    s.add_kfd_node(1, 110000, vendor_id=0x1002, device_id=0x744C, location_id=0x300,
                   drm_render_minor=128)
    s.add_kfd_node(2, 100306, vendor_id=0x1002, device_id=0x164E, location_id=0x1200,
                   drm_render_minor=129)
    s.add_dev_node("/dev/kfd")
    for name in ("amdgpu", "snd_hda_intel", "ccp"):
        s.add_module(name)
    _add_amd_iommu(s)
    s.set_cmdline("BOOT_IMAGE=/boot/vmlinuz-linux root=UUID=77aa rw amd_iommu=on iommu=pt")
    return s


def vfio_noiommu_host(root: str | os.PathLike[str], *, cdev: bool = False) -> SysRoot:
    """A host without an IOMMU (none in firmware, or a VM guest without a vIOMMU) that loaded
    vfio with ``enable_unsafe_noiommu_mode=1`` and bound its NVIDIA T4 to vfio-pci: VFIO made
    the function a group of its own (0, named ``vfio-noiommu``) and its node is
    ``/dev/vfio/noiommu-0``, not ``/dev/vfio/0``. No IOMMU unit, no other group. ``cdev``: a
    kernel with the VFIO device cdev and iommufd, which names the device ``noiommu-vfio0``
    (``/dev/vfio/devices/noiommu-vfio0``)."""
    s = SysRoot(root)
    s.add_function("0000:00:01.0", vendor="0x1234", device="0x1111", klass="0x030000",
                   driver="bochs-drm", subsystem_vendor="0x1af4")
    s.set_attr("0000:00:01.0", "boot_vga", "1\n")
    s.add_drm("card0", "0000:00:01.0")
    s.add_function("0000:00:05.0", vendor=NVIDIA, device="0x1eb8", klass="0x030200",
                   driver="vfio-pci", iommu_group=0)
    (s.root / "sys/kernel/iommu_groups/0/name").write_text("vfio-noiommu\n")
    s.add_dev_node("/dev/vfio/vfio")
    s.add_dev_node("/dev/vfio/noiommu-0")
    if cdev:
        s.add_vfio_dev("0000:00:05.0", 0, noiommu=True)
        s.add_dev_node("/dev/iommu")
    for name in ("vfio", "vfio_pci", "vfio_pci_core"):
        s.add_module(name)
    s.set_cmdline("BOOT_IMAGE=/boot/vmlinuz-6.8.0 ro console=ttyS0 "
                  "vfio.enable_unsafe_noiommu_mode=1")
    return s


def _add_virtio_device(s: SysRoot, addr: str, index: int, driver: str, device_id: int,
                       drm: tuple[str, ...] = ()) -> None:
    """``virtio<index>`` under the virtio-pci function ``addr``, laid out as the virtio bus
    lays out its devices (``vendor``/``device`` in ``0x%04x``, a ``driver`` link into
    ``sys/bus/virtio/drivers``, the bus entry), and its DRM minors in its own ``drm/``
    folder: virtio-gpu registers them on the virtio device, not on the PCI function."""
    base = s.device_dir(addr) / f"virtio{index}"
    base.mkdir()
    alias = f"virtio:d{device_id:08X}v00001AF4"
    for name, text in (("vendor", "0x1af4"), ("device", f"0x{device_id:04x}"),
                       ("status", "0x0000000f"), ("modalias", alias),
                       ("features", "0" * 32 + "1" + "0" * 31)):
        (base / name).write_text(text + "\n")
    (base / "uevent").write_text(f"DRIVER={driver}\nMODALIAS={alias}\n")
    bus = s.root / "sys/bus/virtio"
    drivers, devices = bus / "drivers" / driver, bus / "devices"
    drivers.mkdir(parents=True, exist_ok=True)
    devices.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(drivers, base), base / "driver")
    os.symlink(os.path.relpath(base, drivers), drivers / f"virtio{index}")
    os.symlink(os.path.relpath(base, devices), devices / f"virtio{index}")
    os.symlink(os.path.relpath(bus, base), base / "subsystem")
    for name in drm:
        _drm_minor(s, base, name, f"../../../virtio{index}")


def _drm_minor(s: SysRoot, parent: Path, name: str, device_link: str) -> None:
    """DRM node ``name`` (``cardN``/``renderDN``) under ``parent``'s ``drm/`` folder, as the
    kernel lays it out: its ``device`` link (``device_link``), the class link and /dev node."""
    minor = int(name.removeprefix("card").removeprefix("renderD"))
    node = parent / "drm" / name
    node.mkdir(parents=True)
    (node / "dev").write_text(f"226:{minor}\n")
    (node / "uevent").write_text(
        f"MAJOR=226\nMINOR={minor}\nDEVNAME=dri/{name}\nDEVTYPE=drm_minor\n")
    os.symlink(device_link, node / "device")
    os.symlink(os.path.relpath(node, s.root / "sys/class/drm"), s.root / "sys/class/drm" / name)
    s.add_dev_node(f"/dev/dri/{name}")


def virtio_gpu_guest(root: str | os.PathLike[str]) -> SysRoot:
    """A KVM guest with virtio-gpu as its only display (``0x1af4:0x1050``, VGA class,
    boot_vga 1, bound to ``virtio-pci``; its DRM minors card0/renderD128 hang under
    ``virtio0``, driven by ``virtio_gpu``) and a virtio NIC, on a kernel built without IOMMU
    support, so ``sys/kernel/iommu_groups`` does not exist at all. No PCI function is on a
    GPU driver, and no KFD."""
    s = SysRoot(root)
    s.add_function("0000:00:00.0", vendor=INTEL, device="0x29c0", klass="0x060000",
                   subsystem_vendor="0x1af4", subsystem_device="0x1100")
    s.add_function("0000:00:01.0", vendor="0x1af4", device="0x1050", klass="0x030000",
                   driver="virtio-pci", subsystem_vendor="0x1af4", subsystem_device="0x1100")
    s.set_attr("0000:00:01.0", "boot_vga", "1\n")
    _add_virtio_device(s, "0000:00:01.0", 0, "virtio_gpu", 16, ("card0", "renderD128"))
    s.add_function("0000:00:02.0", vendor="0x1af4", device="0x1041", klass="0x020000",
                   driver="virtio-pci", subsystem_vendor="0x1af4", subsystem_device="0x1100")
    _add_virtio_device(s, "0000:00:02.0", 1, "virtio_net", 1)
    for name in ("virtio_gpu", "virtio_pci", "virtio_net"):
        s.add_module(name)
    s.add_dev_node("/dev/vhost-net")
    s.set_cmdline("BOOT_IMAGE=/boot/vmlinuz-6.8.0-48-generic root=/dev/vda1 ro console=ttyS0")
    s.set_cpuinfo(x86_cpuinfo(hypervisor=True))
    s.set_dmi("QEMU", "Standard PC (Q35 + ICH9, 2009)")
    os.rmdir(s.root / "sys/kernel/iommu_groups")
    return s


def bochs_guest_with_l4(root: str | os.PathLike[str]) -> SysRoot:
    """A QEMU guest: the standard VGA (``0x1234:0x1111``, ``bochs-drm``, boot_vga 1, card0)
    and an NVIDIA L4 passed through to it (3D controller behind QEMU's PCIe root port, on
    ``nvidia``, card1/renderD128), no vIOMMU: ``sys/kernel/iommu_groups`` is there but
    empty. The L4 is usable for containers (module, CDI spec) but no passthrough
    candidate."""
    s = SysRoot(root)
    s.add_function("0000:00:02.0", vendor="0x1234", device="0x1111", klass="0x030000",
                   driver="bochs-drm", subsystem_vendor="0x1af4", subsystem_device="0x1100")
    s.set_attr("0000:00:02.0", "boot_vga", "1\n")
    s.add_drm("card0", "0000:00:02.0")
    s.add_bridge("0000:00:1c.0", vendor="0x1b36", device="0x000c")
    s.add_function("0000:01:00.0", parent="0000:00:1c.0", vendor=NVIDIA, device="0x27b8",
                   klass="0x030200", driver="nvidia", subsystem_device="0x16ca")
    s.add_drm("card1", "0000:01:00.0")
    s.add_drm("renderD128", "0000:01:00.0")
    for name in ("nvidia", "nvidia_modeset", "nvidia_drm", "nvidia_uvm", "bochs"):
        s.add_module(name)
    s.add_dev_node("/dev/nvidia0")
    s.add_dev_node("/dev/nvidiactl")
    s.add_cdi_spec("var")
    s.set_cpuinfo(x86_cpuinfo(hypervisor=True))
    s.set_dmi("QEMU", "Standard PC (Q35 + ICH9, 2009)")
    return s


#: QEMU's bochs-display (``-device bochs-display``): the stdvga's ids without its VGA class.
BOCHS_DISPLAY = "0000:00:02.0"


def bochs_display_viommu_guest(root: str | os.PathLike[str]) -> SysRoot:
    """A QEMU q35 guest whose only display is ``bochs-display`` (``0x1234:0x1111``, class
    0x0380 "Display controller": no VGA, so no ``boot_vga`` file), on ``bochs-drm``, whose
    fbdev emulation holds the console (card0, ``fb0`` ``bochs-drmdrmfb``); with a virtual
    IOMMU (``-device intel-iommu``, ``intel_iommu=on``), so every function is in an IOMMU
    group and the display would be a passthrough candidate but for its console."""
    s = SysRoot(root)
    s.add_function("0000:00:00.0", vendor=INTEL, device="0x29c0", klass="0x060000",
                   iommu_group=0, subsystem_vendor="0x1af4", subsystem_device="0x1100")
    s.add_function(BOCHS_DISPLAY, vendor="0x1234", device="0x1111", klass="0x038000",
                   driver="bochs-drm", iommu_group=1, subsystem_vendor="0x1af4",
                   subsystem_device="0x1100")
    s.add_drm("card0", BOCHS_DISPLAY)
    s.add_framebuffer("fb0", BOCHS_DISPLAY, fb_name="bochs-drmdrmfb")
    s.add_function("0000:00:03.0", vendor="0x1af4", device="0x1041", klass="0x020000",
                   driver="virtio-pci", iommu_group=2, subsystem_vendor="0x1af4",
                   subsystem_device="0x1100")
    s.add_function("0000:00:1f.0", vendor=INTEL, device="0x2918", klass="0x060100",
                   driver="lpc_ich", iommu_group=3, subsystem_vendor="0x1af4",
                   subsystem_device="0x1100")
    for name in ("bochs", "virtio_net", "virtio_pci"):
        s.add_module(name)
    s.add_iommu_unit("dmar0")
    s.set_cmdline("BOOT_IMAGE=/boot/vmlinuz-6.8.0-48-generic root=/dev/vda1 ro intel_iommu=on")
    return s


VIRTIO_GPU = "0000:00:01.0"


def virtio_gpu_viommu_guest(root: str | os.PathLike[str]) -> SysRoot:
    """A KVM guest whose only display is ``virtio-gpu-pci`` (``0x1af4:0x1050``, class 0x0380:
    no VGA, no ``boot_vga`` file), bound to ``virtio-pci``; ``virtio_gpu`` drives its
    ``virtio0`` device, which holds card0/renderD128 and the fbdev emulation's ``fb0``
    (``virtio_gpudrmfb``): the console hangs one level below the PCI function. A
    virtio-iommu (``0x1af4:0x1057``) puts every function in an IOMMU group."""
    s = SysRoot(root)
    s.add_function("0000:00:00.0", vendor=INTEL, device="0x29c0", klass="0x060000",
                   iommu_group=0, subsystem_vendor="0x1af4", subsystem_device="0x1100")
    s.add_function(VIRTIO_GPU, vendor="0x1af4", device="0x1050", klass="0x038000",
                   driver="virtio-pci", iommu_group=1, subsystem_vendor="0x1af4",
                   subsystem_device="0x1100")
    _add_virtio_device(s, VIRTIO_GPU, 0, "virtio_gpu", 16, ("card0", "renderD128"))
    s.add_framebuffer("fb0", VIRTIO_GPU, under="virtio0", fb_name="virtio_gpudrmfb")
    s.add_function("0000:00:02.0", vendor="0x1af4", device="0x1041", klass="0x020000",
                   driver="virtio-pci", iommu_group=2, subsystem_vendor="0x1af4",
                   subsystem_device="0x1100")
    _add_virtio_device(s, "0000:00:02.0", 1, "virtio_net", 1)
    s.add_function("0000:00:03.0", vendor="0x1af4", device="0x1057", klass="0x088000",
                   driver="virtio-pci", subsystem_vendor="0x1af4", subsystem_device="0x1100")
    _add_virtio_device(s, "0000:00:03.0", 2, "virtio_iommu", 23)
    for name in ("virtio_gpu", "virtio_pci", "virtio_net", "virtio_iommu"):
        s.add_module(name)
    s.set_cmdline("BOOT_IMAGE=/boot/vmlinuz-6.8.0-48-generic root=/dev/vda1 ro")
    return s


def _add_platform_device(s: SysRoot, devpath: str, *, driver: str = "", compatible: str = "",
                         iommu_group: int | None = None) -> Path:
    """A device-tree platform device at ``devpath`` (``/devices/platform/bus@0/3610000.usb``)
    as the platform bus lays it out: its ``uevent`` (``DRIVER``, ``OF_COMPATIBLE_0``, no
    ``PCI_SLOT_NAME``), the bus entry and ``driver`` link, and, behind an SMMU, its IOMMU
    group both ways (platform devices have groups of their own beside the PCI functions')."""
    base = s.root / ("sys" + devpath)
    base.mkdir(parents=True, exist_ok=True)
    name = base.name
    lines = [f"DRIVER={driver}"] if driver else []
    lines += [f"OF_NAME={name.rpartition('.')[2]}", f"OF_COMPATIBLE_0={compatible}",
              "OF_COMPATIBLE_N=1", f"MODALIAS=of:N{name.rpartition('.')[2]}T(null)C{compatible}"]
    (base / "uevent").write_text("\n".join(lines) + "\n")
    bus = s.root / "sys/bus/platform"
    (bus / "devices").mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(base, bus / "devices"), bus / "devices" / name)
    os.symlink(os.path.relpath(bus, base), base / "subsystem")
    if driver:
        folder = bus / "drivers" / driver
        folder.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(folder, base), base / "driver")
        os.symlink(os.path.relpath(base, folder), folder / name)
    if iommu_group is not None:
        group = s.root / f"sys/kernel/iommu_groups/{iommu_group}"
        (group / "devices").mkdir(parents=True, exist_ok=True)
        if not (group / "type").exists():
            (group / "type").write_text("DMA\n")
        os.symlink(os.path.relpath(base, group / "devices"), group / "devices" / name)
        os.symlink(os.path.relpath(group, base), base / "iommu_group")
    return base


#: The dGPU of `jetson_orin_host`, in the x8 slot's controller's PCI domain.
ORIN_DGPU = "0005:01:00.0"


def jetson_orin_host(root: str | os.PathLike[str]) -> SysRoot:
    """An NVIDIA Jetson AGX Orin (arm64, device tree) with an RTX A4000 in its PCIe slot.
    Every device hangs below the SoC's ``platform/bus@0``: the SMMUs (``arm,mmu-500``:
    units ``smmu.0x…`` under ``bus@0/12000000.iommu`` and ``bus@0/8000000.iommu``), the
    USB, Ethernet and host1x platform devices, each in an IOMMU group of its own, and the
    PCIe controllers, whose root buses carry the device tree's domains
    (``bus@0/14100000.pcie/pci0001:00``, ``bus@0/141a0000.pcie/pci0005:00``). tegra-drm's
    card0/renderD128 hang under host1x (a platform device, no PCI ids); the A4000
    (``0005:01:00.0``, ``nvidia``, card1/renderD129) shares group 20 with its HDMI audio and
    the controller's root port, which has no ACS."""
    s = SysRoot(root)
    bus0 = "/devices/platform/bus@0"
    for unit in ("12000000", "8000000"):
        s.add_iommu_unit(f"smmu.0x{int(unit, 16):016x}", at=f"bus@0/{unit}.iommu")
    for devpath, driver, compatible, group in (
            (f"{bus0}/3610000.usb", "tegra-xusb", "nvidia,tegra234-xusb", 2),
            (f"{bus0}/2310000.ethernet", "nvethernet", "nvidia,nvmgbe", 3),
            (f"{bus0}/13e00000.host1x", "tegra-host1x", "nvidia,tegra234-host1x", 4)):
        _add_platform_device(s, devpath, driver=driver, compatible=compatible,
                             iommu_group=group)
    host1x = s.root / ("sys" + bus0) / "13e00000.host1x"
    for name in ("card0", "renderD128"):
        _drm_minor(s, host1x, name, "../../../13e00000.host1x")
    for domain, controller, port_id, group in (("0001", "14100000.pcie", "0x229e", 10),
                                                ("0005", "141a0000.pcie", "0x229a", 20)):
        _add_platform_device(s, f"{bus0}/{controller}", driver="tegra194-pcie",
                             compatible="nvidia,tegra234-pcie", iommu_group=group - 1)
        root_bus = s.add_root_bus(f"pci{domain}:00", f"{bus0}/{controller}")
        s.add_bridge(f"{domain}:00:00.0", parent=root_bus, vendor=NVIDIA, device=port_id,
                     iommu_group=group)
    s.add_function("0001:01:00.0", parent="0001:00:00.0", vendor="0x10ec", device="0x8168",
                   klass="0x020000", driver="r8168", iommu_group=10, subsystem_vendor="0x10ec")
    s.add_function(ORIN_DGPU, parent="0005:00:00.0", vendor=NVIDIA, device="0x24b0",
                   klass="0x030000", driver="nvidia", iommu_group=20)
    s.add_function("0005:01:00.1", parent="0005:00:00.0", vendor=NVIDIA, device="0x228b",
                   klass="0x040300", driver="snd_hda_intel", iommu_group=20)
    s.add_drm("card1", ORIN_DGPU)
    s.add_drm("renderD129", ORIN_DGPU)
    for name in ("nvidia", "nvidia_modeset", "nvidia_drm", "nvidia_uvm", "tegra_drm", "r8168"):
        s.add_module(name)
    s.add_dev_node("/dev/nvidia0")
    s.add_dev_node("/dev/nvidiactl")
    s.add_cdi_spec("var")
    s.set_cmdline("root=/dev/nvme0n1p1 rw rootwait console=ttyTCU0,115200 fbcon=map:0")
    s.set_cpuinfo(ARM64_CPUINFO.replace("0xd0c", "0xd42"))  # Cortex-A78AE
    return s


#: The A100 of `ampere_altra_host`, in the Altra's PCIe domain 000c.
ALTRA_GPU = "000c:01:00.0"


def ampere_altra_host(root: str | os.PathLike[str], *, smmu: str = "groups") -> SysRoot:
    """An Ampere Altra server (arm64, ACPI: no device tree; its board maker's DMI strings)
    with an NVIDIA A100 PCIe (``000c:01:00.0``, 3D controller, ``nvidia``) and its root port
    in domain 000c. ``smmu``: ``"groups"`` (the SMMUv3 registered, the A100 in IOMMU group
    5), ``"unit"`` (the SMMUv3 registered, but the firmware's IORT routes no root complex
    through it: no group at all) or ``"none"`` (the SMMU off in the firmware: no unit, no
    group)."""
    if smmu not in ("groups", "unit", "none"):
        raise ValueError(f"smmu must be groups, unit or none, not {smmu!r}")
    s = SysRoot(root)
    grouped = smmu == "groups"
    if smmu != "none":
        s.add_iommu_unit("smmu3.0x0000100002000000", at="arm-smmu-v3.0.auto")
    s.add_bridge("000c:00:01.0", domain_root="pci000c:00", iommu_group=4 if grouped else None,
                 vendor="0x1def", device="0xe101")
    s.add_function(ALTRA_GPU, parent="000c:00:01.0", vendor=NVIDIA, device="0x20f1",
                   klass="0x030200", driver="nvidia", iommu_group=5 if grouped else None,
                   subsystem_device="0x145f")
    s.add_drm("card0", ALTRA_GPU)
    s.add_drm("renderD128", ALTRA_GPU)
    for name in ("nvidia", "nvidia_modeset", "nvidia_drm", "nvidia_uvm"):
        s.add_module(name)
    s.add_dev_node("/dev/nvidia0")
    s.add_dev_node("/dev/nvidiactl")
    s.set_cmdline("BOOT_IMAGE=/boot/vmlinuz-6.8.0-45-generic-64k root=UUID=5c1e ro")
    s.set_cpuinfo(ARM64_CPUINFO)
    s.set_dmi("GIGABYTE", "G242-P33-00")
    return s


#: The A100 of `hyperv_gpu_guest`: Hyper-V's vPCI names the domain after the GUID of the
#: VMBus channel that carries the device (bytes 4-5: ``47505500-0001-…`` gives 0001).
HYPERV_GPU = "0001:00:00.0"


def hyperv_gpu_guest(root: str | os.PathLike[str]) -> SysRoot:
    """An Azure NC A100 v4 VM: Hyper-V passes the A100 PCIe (``0x10de:0x20b5``, 3D controller,
    ``nvidia``) and a ConnectX VF through vPCI, each on a root bus of its own inside its
    VMBus channel's folder (``…/VMBUS:01/47505500-0001-…/pci0001:00/0001:00:00.0``), with a
    domain from the channel's GUID (``c3bc`` for the VF). The console is hyperv_drm's
    card0 on the synthetic video channel (a VMBus device: vendor ``0x1414``, no PCI
    function). No vIOMMU: ``sys/kernel/iommu_groups`` is empty."""
    s = SysRoot(root)
    vmbus = "/devices/LNXSYSTM:00/LNXSYBUS:00/PNP0A03:00/device:07/VMBUS:01"
    gpu_bus = s.add_root_bus("pci0001:00", f"{vmbus}/47505500-0001-0000-3130-444531303244")
    s.add_function(HYPERV_GPU, parent=gpu_bus, vendor=NVIDIA, device="0x20b5",
                   klass="0x030200", driver="nvidia", subsystem_device="0x1533")
    nic_bus = s.add_root_bus("pcic3bc:00", f"{vmbus}/000d3a8e-c3bc-000d-3a8e-c3bc000d3a8e")
    s.add_function("c3bc:00:02.0", parent=nic_bus, vendor="0x15b3", device="0x101e",
                   klass="0x020000", driver="mlx5_core", subsystem_vendor="0x15b3")
    video = s.root / ("sys" + vmbus) / "5620e0c7-8062-4dce-aeb7-520c7ef76171"
    video.mkdir()
    (video / "vendor").write_text("0x1414\n")
    (video / "device").write_text("0x5353\n")
    (video / "uevent").write_text(
        "DRIVER=hyperv_drm\nMODALIAS=vmbus:02780ada77e3ac4a8e770558eb1073f8\n")
    _drm_minor(s, video, "card0", "../../../5620e0c7-8062-4dce-aeb7-520c7ef76171")
    s.add_drm("card1", HYPERV_GPU)
    s.add_drm("renderD128", HYPERV_GPU)
    for name in ("nvidia", "nvidia_modeset", "nvidia_drm", "nvidia_uvm", "hyperv_drm",
                 "mlx5_core", "pci_hyperv"):
        s.add_module(name)
    s.add_cdi_spec("etc")
    s.add_dev_node("/dev/nvidia0")
    s.add_dev_node("/dev/nvidiactl")
    s.set_cmdline("BOOT_IMAGE=/boot/vmlinuz-6.5.0-1025-azure root=PARTUUID=4d1e ro "
                  "console=tty1 console=ttyS0 earlyprintk=ttyS0")
    s.set_cpuinfo(x86_cpuinfo(hypervisor=True))
    s.set_dmi("Microsoft Corporation", "Virtual Machine")
    return s


H100_PCIE = "0000:41:00.0"


def headless_compute_host(root: str | os.PathLike[str]) -> SysRoot:
    """A compute node with no console display at all: one NVIDIA H100 PCIe (``0x10de:0x2331``,
    a 3D controller 0x0302: no ``boot_vga`` file) on ``nvidia`` in IOMMU group 40, with
    nvidia-drm's card0/renderD128 but no framebuffer (no connector, so no fbdev), a NIC
    and an NVMe drive. The H100 is its only display function, and no console of the
    host's."""
    s = SysRoot(root)
    s.add_function("0000:00:00.0", vendor=AMD_CPU, device="0x14a4", klass="0x060000",
                   iommu_group=0, subsystem_vendor=AMD_CPU)
    s.add_bridge("0000:40:01.1", iommu_group=39, vendor=AMD_CPU, device="0x14ab")
    s.add_function(H100_PCIE, parent="0000:40:01.1", vendor=NVIDIA, device="0x2331",
                   klass="0x030200", driver="nvidia", iommu_group=40,
                   subsystem_device="0x1626")
    s.add_drm("card0", H100_PCIE)
    s.add_drm("renderD128", H100_PCIE)
    s.add_function("0000:c1:00.0", vendor="0x15b3", device="0x1021", klass="0x020000",
                   driver="mlx5_core", iommu_group=50, subsystem_vendor="0x15b3")
    s.add_function("0000:c2:00.0", vendor="0x144d", device="0xa80a", klass="0x010802",
                   driver="nvme", iommu_group=51, subsystem_vendor="0x144d")
    for name in ("nvidia", "nvidia_modeset", "nvidia_drm", "nvidia_uvm", "mlx5_core", "nvme"):
        s.add_module(name)
    s.add_dev_node("/dev/nvidia0")
    s.add_dev_node("/dev/nvidiactl")
    _add_amd_iommu(s)
    s.set_cmdline("BOOT_IMAGE=/vmlinuz ro console=ttyS0,115200 nvidia-drm.modeset=1")
    return s


#: An MI300X's SR-IOV VF (``lspci``: ``Aqua Vanjaram [Instinct MI300X VF] [1002:74b5]``).
MI300X_VF = "0x74b5"


def mxgpu_host(root: str | os.PathLike[str], *, vfs: int = 4) -> SysRoot:
    """AMD MxGPU: an MI300X (``0x1002:0x74a1``, Processing accelerator 0x1200) on AMD's host
    driver ``gim``, SR-IOV on (8 VFs at most, offset 2), ``vfs`` VFs (``0x74b5``) on
    vfio-pci for guests, each in its own IOMMU group from 11 on. gim is no amdgpu: no DRM,
    no KFD on the host."""
    s = SysRoot(root)
    s.add_bridge("0000:04:00.0", domain_root="pci0000:00", iommu_group=9, vendor=AMD,
                 device="0x14ab")
    pf = "0000:05:00.0"
    s.add_function(pf, parent="0000:04:00.0", vendor=AMD, device="0x74a1",
                   klass=ACCELERATOR_CLASS, driver="gim", iommu_group=10,
                   subsystem_vendor=AMD, subsystem_device="0x74a1")
    s.enable_sriov(pf, 8, vf_device=MI300X_VF, offset=2)
    s.add_vfs(pf, vfs, driver="vfio-pci", first_group=11)
    for i in range(vfs):
        s.add_vfio_group(11 + i)
    for name in ("gim", "vfio", "vfio_pci"):
        s.add_module(name)
    _add_amd_iommu(s)
    s.set_cmdline("BOOT_IMAGE=/vmlinuz-5.15.0-100-generic ro amd_iommu=on iommu=pt")
    return s


def headless_host(root: str | os.PathLike[str], *, iommu: str = "off") -> SysRoot:
    """A server with no GPU at all: no DRM, no KFD, no /dev/dri; an onboard NIC and a USB
    controller. ``iommu``: ``"off"`` (a kernel without IOMMU support: no
    ``sys/kernel/iommu_groups``), ``"empty"`` (the folder there, no group: no IOMMU in the
    firmware) or ``"pt"`` (VT-d on in passthrough mode, ``iommu=pt``: every function in a
    group as usual)."""
    if iommu not in ("off", "empty", "pt"):
        raise ValueError(f"iommu must be off, empty or pt, not {iommu!r}")
    s = SysRoot(root)
    pt = iommu == "pt"
    s.add_function("0000:00:00.0", vendor=INTEL, device="0x3e30", klass="0x060000",
                   iommu_group=1 if pt else None)
    s.add_function("0000:00:14.0", vendor=INTEL, device="0xa36d", klass="0x0c0330",
                   driver="xhci_hcd", iommu_group=4 if pt else None)
    s.add_function("0000:00:1f.6", vendor=INTEL, device="0x15bc", klass="0x020000",
                   driver="e1000e", iommu_group=7 if pt else None)
    s.add_dev_node("/dev/kvm")
    if pt:
        s.add_iommu_unit("dmar0")
        s.set_cmdline("BOOT_IMAGE=/vmlinuz ro intel_iommu=on iommu=pt")
    else:
        s.set_cmdline("BOOT_IMAGE=/vmlinuz ro")
    if iommu == "off":
        os.rmdir(s.root / "sys/kernel/iommu_groups")
    return s


__all__ = [
    "ALTRA_GPU",
    "ARM64_CPUINFO",
    "amd_apu_dgpu_host",
    "ampere_altra_host",
    "arc_desktop_host",
    "bmc_server_host",
    "bochs_display_viommu_guest",
    "bochs_guest_with_l4",
    "headless_compute_host",
    "headless_host",
    "hgx_h100_host",
    "hpe_ilo_host",
    "hybrid_laptop_host",
    "hyperv_gpu_guest",
    "igpu_sriov_host",
    "instinct_host",
    "intel_flex_sriov_host",
    "jetson_orin_host",
    "mi300x_cpx_host",
    "mxgpu_host",
    "single_gpu_desktop",
    "turing_desktop_host",
    "vfio_noiommu_host",
    "virtio_gpu_guest",
    "virtio_gpu_viommu_guest",
    "vm_guest_host",
    "vmd_host",
    "x86_cpuinfo",
]
