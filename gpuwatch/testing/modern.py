"""Fixture hosts of the newer VFIO world: device cdevs and iommufd, vfio-pci variant drivers,
SR-IOV GPUs and NVIDIA vGPU VFs (docs/probes.md, docs/switch.md).

Laid out the way those kernels lay them out: ``vfio-dev/vfioN`` under the function (with a
``dev`` file only on kernels built with the VFIO device cdev), ``/dev/vfio/devices/vfioN`` and
``/dev/iommu``, the PF's ``sriov_*`` attributes and ``virtfnN`` links, each VF's ``physfn``
link, an NVIDIA vGPU VF's ``nvidia/`` directory, and ``lib/modules/<release>/modules.alias``
as depmod writes it.
"""

from __future__ import annotations

import os

from gpuwatch.testing.sysroot import Layout, SysRoot, example_gpu_host

__all__ = [
    "GH_ADDR",
    "KERNEL_RELEASE",
    "MODULES_ALIAS",
    "SRIOV_PF",
    "grace_hopper_host",
    "iommufd_only_host",
    "sriov_gpu_host",
]

KERNEL_RELEASE = "6.8.0-1013-nvidia-64k"
GH_ADDR = "0009:01:00.0"  # GH200's Hopper function: domain 9 on a Grace-Hopper superchip
GH_GROUP = 19
SRIOV_PF = "0000:41:00.0"  # an L40S-like PF; its VFs start at function 4 (offset 4)

#: A slice of a real modules.alias: the vfio_pci aliases depmod writes for vfio-pci itself
#: (generic, from PCI_DRIVER_OVERRIDE_DEVICE_VFIO(PCI_ANY_ID, PCI_ANY_ID)) and for variant
#: drivers, among ordinary pci: aliases that must be ignored.
MODULES_ALIAS = """\
# Aliases extracted from modules themselves.
alias pci:v000010DEd*sv*sd*bc03sc*i* nvidia
alias pci:v000010DEd*sv*sd*bc04sc80i00* nvidia
alias pci:v*d*sv*sd*bc04sc03i00* snd_hda_intel
alias vfio_pci:v*d*sv*sd*bc*sc*i* vfio_pci
alias vfio_pci:v000010DEd00002342sv*sd*bc*sc*i* nvgrace_gpu_vfio_pci
alias vfio_pci:v000010DEd00002345sv*sd*bc*sc*i* nvgrace_gpu_vfio_pci
alias vfio_pci:v000010DEd00002348sv*sd*bc*sc*i* nvgrace_gpu_vfio_pci
alias vfio_pci:v000015B3d0000101Esv*sd*bc*sc*i* mlx5_vfio_pci
alias vfio_pci:v00008086d00004940sv*sd*bc*sc*i* qat_vfio_pci
alias pci:v000015B3d0000101Esv*sd*bc*sc*i* mlx5_core
alias vfio_pci:v00001DD8d00001003sv*sd*bc*sc*i* pds_vfio_pci
"""


def grace_hopper_host(root: str | os.PathLike[str], *, cdev: bool = True,
                      iommufd: bool = True, bound: bool = True) -> SysRoot:
    """A Grace-Hopper-like node: the Hopper function (3D controller ``0x10de:0x2342``) alone
    in IOMMU group 19 behind an SMMUv3, bound to ``nvgrace_gpu_vfio_pci`` with ``vfio-dev/vfio0``
    (``cdev``: the kernel has the VFIO device cdev) and ``/dev/iommu`` (``iommufd``).
    With ``bound=False`` the function is on ``nvidia`` and has no VFIO entry."""
    s = SysRoot(root)
    s.add_iommu_unit("smmu3.0x0000000016000000", at="arm-smmu-v3.0.auto")
    s.set_cmdline("BOOT_IMAGE=/vmlinuz iommu.passthrough=0 init_on_alloc=0")
    s.add_bridge("0009:00:00.0", domain_root="pci0009:00", iommu_group=18,
                 vendor="0x10de", device="0x22b2")
    s.add_function(GH_ADDR, parent="0009:00:00.0", vendor="0x10de", device="0x2342",
                   klass="0x030200", driver="nvgrace_gpu_vfio_pci" if bound else "nvidia",
                   iommu_group=GH_GROUP, subsystem_vendor="0x10de", subsystem_device="0x16eb")
    s.add_modules_alias(KERNEL_RELEASE, MODULES_ALIAS)
    for name in ("vfio", "vfio_pci_core", "vfio_pci", "nvgrace_gpu_vfio_pci", "nvidia"):
        s.add_module(name)
    if iommufd:
        s.add_module("iommufd")
        s.add_dev_node("/dev/iommu")
    if bound:
        s.add_vfio_group(GH_GROUP, mode=0o660)
        s.add_vfio_dev(GH_ADDR, 0, cdev=cdev)
    s.add_dev_node("/dev/kvm")
    return s


def iommufd_only_host(root: str | os.PathLike[str]) -> SysRoot:
    """The example workstation (GPU ``0000:01:00.0`` and its HDMI audio ``0000:01:00.1`` in
    IOMMU group 13) on a kernel built without the VFIO group interface (``CONFIG_VFIO_GROUP``
    off): both functions on vfio-pci, each with its device cdev (``/dev/vfio/devices/vfio0``,
    ``vfio1``) and ``/dev/iommu``, but no ``/dev/vfio/13`` and no ``/dev/vfio/vfio``."""
    s = example_gpu_host(root)
    for addr in ("0000:01:00.0", "0000:01:00.1"):
        s.unbind(addr)
    for name in ("nvidia_drm", "nvidia_modeset", "nvidia_uvm", "nvidia"):
        if os.path.isdir(os.path.join(s.root, "sys/module", name)):
            s.remove_module(name)
    for name in ("iommufd", "vfio", "vfio_pci_core", "vfio_pci"):
        s.add_module(name)
    s.add_dev_node("/dev/iommu")
    for index, addr in enumerate(("0000:01:00.0", "0000:01:00.1")):
        s.bind(addr, "vfio-pci")
        s.add_vfio_dev(addr, index)
    return s


def sriov_gpu_host(root: str | os.PathLike[str], *, vfs: int = 0, vgpu: bool = False,
                   totalvfs: int = 16, layout: Layout = "symlink") -> SysRoot:
    """An SR-IOV GPU (``0x10de:0x26b9`` PF on ``nvidia``, group 40) with ``vfs`` VFs enabled,
    each in its own IOMMU group from 41 on. With ``vgpu`` the VFs are bound to ``nvidia`` and
    carry NVIDIA vGPU's ``nvidia/`` files (no type chosen yet). ``layout``: `SysRoot`'s."""
    s = SysRoot(root, layout=layout)
    s.add_iommu_unit("dmar0")
    s.set_cmdline("intel_iommu=on iommu=pt")
    s.add_bridge("0000:40:01.0", domain_root="pci0000:40", iommu_group=39)
    s.add_function(SRIOV_PF, parent="0000:40:01.0", vendor="0x10de", device="0x26b9",
                   klass="0x030200", driver="nvidia", iommu_group=40,
                   subsystem_vendor="0x10de", subsystem_device="0x1851")
    s.enable_sriov(SRIOV_PF, totalvfs, vf_device="0x26b9", offset=4)
    s.add_module("nvidia")
    s.add_module("vfio")
    s.add_module("vfio_pci")
    s.add_modules_alias("6.8.0-45-generic", MODULES_ALIAS)
    if vfs:
        add_vfs(s, vfs, vgpu=vgpu)
    return s


VGPU_TYPES = ((1155, "NVIDIA L40S-1Q"), (1156, "NVIDIA L40S-2Q"), (1157, "NVIDIA L40S-3Q"),
              (1158, "NVIDIA L40S-4Q"))


def add_vfs(s: SysRoot, count: int, *, vgpu: bool = False) -> list[str]:
    """VFs of `SRIOV_PF` as the kernel adds them; vGPU VFs on ``nvidia`` with their files."""
    added = s.add_vfs(SRIOV_PF, count, driver="nvidia" if vgpu else None, first_group=41)
    if vgpu:
        for vf in added:
            s.set_vgpu(vf, 0, VGPU_TYPES)
    return added
