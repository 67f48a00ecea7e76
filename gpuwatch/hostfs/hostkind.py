"""The few files that tell the host's CPU architecture and whether it is a VM guest
(`gpuwatch.core.hostkind`), read under a root, bounded and tolerant: anything missing,
unreadable or garbled reads as ``""`` and the kind as not known.

Each file is a regular file in a real folder of the kernel's trees, so a copy that turned
links into folders keeps it: ``sys/devices/system/cpu/modalias`` (``proc/cpuinfo`` only
where that says nothing), ``sys/hypervisor/type``,
``sys/firmware/devicetree/base/compatible``, the ids of PCI function ``0000:00:00.0`` and the
DMI strings,
read through ``sys/class/dmi/id`` (every link on the way read as in a chroot) or, in a copy
without the class folder, at ``sys/devices/virtual/dmi/id``. Stdlib only: the stdlib
`status` path reads it too."""

from __future__ import annotations

from gpuwatch.core.hostkind import HostKind, host_kind, modalias_facts
from gpuwatch.hostfs.files import in_tree, read_attr

#: The function whose ids name a rust-vmm guest (`gpuwatch.core.hostkind.RUST_VMM_PCI_ROOT`).
_PCI_ROOT = "0000:00:00.0"
#: Where the kernel keeps the DMI strings, the class link first.
_DMI_DIRS = ("sys/class/dmi/id", "sys/devices/virtual/dmi/id")


def _attr(root: str, rel: str) -> str:
    path = in_tree(root, rel)
    return read_attr(path) if path else ""


def _dmi(root: str, name: str) -> str:
    for folder in _DMI_DIRS:
        text = _attr(root, f"{folder}/{name}")
        if text:
            return text
    return ""


def read_host_kind(root: str) -> HostKind:
    """The `HostKind` of the tree under ``root``."""
    modalias = _attr(root, "sys/devices/system/cpu/modalias")
    # Only where the modalias says nothing: one read of at most 64 KiB (`read_attr`),
    # procfs hands out whole processor stanzas, and only the first is parsed.
    cpuinfo = "" if modalias_facts(modalias)[0] else _attr(root, "proc/cpuinfo")
    pci_root = f"sys/bus/pci/devices/{_PCI_ROOT}"
    return host_kind(cpuinfo, modalias,
                     _dmi(root, "sys_vendor"), _dmi(root, "product_name"),
                     _attr(root, "sys/hypervisor/type"),
                     _attr(root, "sys/firmware/devicetree/base/compatible"),
                     (_attr(root, f"{pci_root}/vendor"), _attr(root, f"{pci_root}/device")))


__all__ = ["read_host_kind"]
