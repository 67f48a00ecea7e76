"""What kind of machine the host is, from a few small files the scan reads: its CPU
architecture and whether it is a virtual machine guest. Only the advice on turning the IOMMU
on depends on it (`gpuwatch.core.reporttext.iommu_hint`): VT-d/AMD-Vi and
``intel_iommu=on`` are x86 firmware and kernel switches; an arm64 host needs its SMMU, and
a guest needs a virtual IOMMU from its hypervisor, which no setting inside it gives.

Pure and stdlib-only (a NamedTuple, no dataclasses): the stdlib `status` path reads it too.
"""

from __future__ import annotations

from typing import NamedTuple

#: The x86 CPU feature number of the ``hypervisor`` flag (``X86_FEATURE_HYPERVISOR``, word 4
#: bit 31: CPUID.1:ECX[31], which every hypervisor sets) as the CPU's ``modalias`` lists
#: features: ``%04X``.
X86_HYPERVISOR_FEATURE = "009F"

#: A hypervisor's key, as `hypervisor_from_dmi` names it, and how the advice names it.
HYPERVISOR_NAMES = {
    "kvm": "QEMU/KVM",
    "hyperv": "Hyper-V",
    "vmware": "VMware",
    "virtualbox": "VirtualBox",
    "xen": "Xen",
    "amazon": "Amazon EC2",
    "google": "Google Compute Engine",
    "parallels": "Parallels",
    "rust-vmm": "Cloud Hypervisor or Firecracker",
    "other": "an unnamed hypervisor",
}
#: Hypervisors that give a guest no virtual IOMMU at all.
NO_VIOMMU = frozenset({"hyperv", "amazon", "google"})


class HostKind(NamedTuple):
    """``arch``: ``"x86"``, ``"arm64"``, or ``""`` (not known, or another architecture).
    ``hypervisor``: a key of `HYPERVISOR_NAMES` for a guest, ``""`` for bare metal or when
    nothing says."""

    arch: str = ""
    hypervisor: str = ""


#: A host nothing was read of: x86 bare metal's advice, as before any was read.
UNKNOWN_HOST = HostKind()


def cpuinfo_facts(text: str) -> tuple[str, bool | None]:
    """``(arch, hypervisor flag)`` from the first stanza of ``proc/cpuinfo``: x86 lists
    ``vendor_id`` and ``flags`` (``hypervisor`` among them in a guest), arm64 ``CPU
    implementer`` and ``CPU architecture: 8``. ``("", None)`` when it says neither."""
    fields: dict[str, str] = {}
    for line in text.lstrip().partition("\n\n")[0].splitlines():  # the first stanza only
        if not line.strip():
            if fields:
                break  # the first processor is enough
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    if "flags" in fields and ("vendor_id" in fields or "cpu family" in fields):
        return "x86", "hypervisor" in fields["flags"].split()
    if "CPU implementer" in fields:
        version = fields.get("CPU architecture", "")
        return ("arm64" if version in ("8", "9") or version.lower() == "aarch64" else ""), None
    return "", None


def modalias_facts(text: str) -> tuple[str, bool | None]:
    """``(arch, hypervisor flag)`` from ``sys/devices/system/cpu/modalias``
    (``cpu:type:x86,ven0000fam0006mod009E:feature:,0000,…``, ``cpu:type:aarch64:feature:…``):
    the same facts as ``proc/cpuinfo`` from one short sysfs file, which costs the kernel
    nothing per CPU (``cpuinfo`` formats every processor it hands out)."""
    if not text.startswith("cpu:type:"):
        return "", None
    kind, _, rest = text[len("cpu:type:"):].partition(":")
    arch = kind.partition(",")[0]
    if arch == "x86":
        _, _, features = rest.partition("feature:")
        return "x86", X86_HYPERVISOR_FEATURE in features.strip().split(",")
    return ("arm64" if arch in ("aarch64", "arm64") else ""), None


def hypervisor_from_dmi(sys_vendor: str, product_name: str, xen_type: str = "") -> str:
    """The hypervisor the firmware's DMI strings (``sys/class/dmi/id/sys_vendor``,
    ``product_name``) or ``sys/hypervisor/type`` (``xen``) name, ``""`` for none. A bare-metal
    cloud instance (EC2's ``*.metal``) and Microsoft's own hardware (a Surface: no
    ``Virtual Machine``) are no guests."""
    vendor, product = sys_vendor.strip().lower(), product_name.strip().lower()
    if xen_type.strip().lower() == "xen" or vendor == "xen":
        return "xen"
    if (vendor in ("qemu", "openstack foundation", "nutanix") or vendor.startswith("red hat")
            or product.startswith("kvm") or product == "openstack nova"):
        return "kvm"
    if vendor == "microsoft corporation" and product == "virtual machine":
        return "hyperv"
    if vendor.startswith("vmware"):
        return "vmware"
    if vendor == "innotek gmbh" or product == "virtualbox":
        return "virtualbox"
    if vendor == "amazon ec2" and product and not product.endswith(".metal"):
        return "amazon"
    if vendor == "google" and product == "google compute engine":
        return "google"
    if vendor.startswith("parallels"):
        return "parallels"
    return ""


#: The PCI host bridge the rust-vmm hypervisors (Cloud Hypervisor, Firecracker, Dragonball)
#: put at ``0000:00:00.0``: "Intel" ``0x0d57``, their own virtual PCIe host, no real part.
#: Their guests have no DMI strings (no SMBIOS table) to name them.
RUST_VMM_PCI_ROOT = ("0x8086", "0x0d57")


def hypervisor_from_pci_root(vendor: str, device: str) -> str:
    """The hypervisor the bus's first function (``0000:00:00.0``) names by its ids, ``""``
    for none."""
    if (vendor.strip().lower(), device.strip().lower()) == RUST_VMM_PCI_ROOT:
        return "rust-vmm"
    return ""


#: The device tree's root ``compatible`` of QEMU's ``virt`` machine booted without firmware
#: (``-kernel``, no UEFI): it has no DMI strings to name it.
DUMMY_VIRT = "linux,dummy-virt"


def host_kind(cpuinfo: str, cpu_modalias: str, sys_vendor: str, product_name: str,
              xen_type: str = "", dt_compatible: str = "",
              pci_root: tuple[str, str] = ("", "")) -> HostKind:
    """The host's `HostKind` from the texts the scan read (each ``""`` when absent): the
    CPU's ``modalias`` first, ``proc/cpuinfo`` where it names no architecture. On x86
    the CPU's ``hypervisor`` flag decides whether it is a guest (the DMI strings only name
    the hypervisor: a bare-metal host may carry any); elsewhere, with no such flag, the DMI
    strings, ``sys/hypervisor`` and the device tree's root ``compatible`` (its strings
    NUL-separated) decide. ``pci_root``: ``0000:00:00.0``'s ``(vendor, device)``, which
    names a guest without DMI strings (`hypervisor_from_pci_root`)."""
    arch, flag = modalias_facts(cpu_modalias)
    if not arch:
        arch, flag = cpuinfo_facts(cpuinfo)
    named = hypervisor_from_dmi(sys_vendor, product_name, xen_type)
    if not named and DUMMY_VIRT in dt_compatible.split("\0"):
        named = "kvm"
    if not named:
        named = hypervisor_from_pci_root(*pci_root)
    if flag is False:
        return HostKind(arch, "")
    if flag:
        return HostKind(arch, named or "other")
    return HostKind(arch, named)


__all__ = ["HYPERVISOR_NAMES", "NO_VIOMMU", "UNKNOWN_HOST", "HostKind", "cpuinfo_facts",
           "host_kind", "hypervisor_from_dmi", "hypervisor_from_pci_root", "modalias_facts"]
