"""PCI addresses and class codes: parsing rules shared by the scan, the model and the switch."""

from __future__ import annotations

import re

#: Canonical sysfs spelling, lower-case hex. The switch refuses anything else before writing.
PCI_ADDR_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
#: Accepted on the command line (upper-case hex too); normalised to lower case.
_PCI_ADDR_LOOSE_RE = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
DRIVER_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


def is_pci_addr(name: str) -> bool:
    """True for a canonical ``DDDD:BB:DD.F`` address (entries like ``pci0000:00`` are not)."""
    return PCI_ADDR_RE.fullmatch(name) is not None


def normalize_addr(text: str) -> str | None:
    """The canonical form of a user-given address, or None when it is not one."""
    if _PCI_ADDR_LOOSE_RE.fullmatch(text) is None:
        return None
    return text.lower()


def is_driver_name(name: str) -> bool:
    return DRIVER_NAME_RE.fullmatch(name) is not None and name not in (".", "..")


def class_prefix(raw: str) -> str:
    """``"0x030000"`` → ``"0x0300"``; ``""`` when the class file was missing or too short."""
    raw = raw.strip()
    if len(raw) < 6:
        return ""
    return raw[:6]


def is_gpu_class(klass: str) -> bool:
    """Display controllers (VGA, 3D, other) are the GPUs of the probe contract."""
    return klass.startswith("0x03")


def parse_group(name: str) -> int:
    """An IOMMU group number from the basename of the ``iommu_group`` link; -1 if not a number."""
    if name.isascii() and name.isdigit():
        return int(name)
    return -1
