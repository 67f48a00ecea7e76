"""PCI addresses and class codes: parsing rules shared by the scan, the model and the switch."""

from __future__ import annotations

import re

from gpuwatch.errors import UsageError

#: Canonical sysfs spelling, lower-case hex: the kernel prints the domain with ``%04x``, so it
#: is 4 digits, or up to 8 when it does not fit (Intel VMD puts devices in domain ``10000``).
#: The switch refuses anything else before writing.
PCI_ADDR_PATTERN = r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]"
PCI_ADDR_RE = re.compile(PCI_ADDR_PATTERN)
#: Accepted from users (upper-case hex, a zero-padded domain); normalised by `canonical_addr`.
_PCI_ADDR_LOOSE_RE = re.compile(r"([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])")
DRIVER_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
#: A PCI vendor id as users write it: ``0x10de``, ``10DE``.
VENDOR_RE = re.compile(r"^(?:0x)?([0-9a-fA-F]{4})$")


def is_pci_addr(name: str) -> bool:
    """True for a canonical ``DDDD:BB:DD.F`` address (entries like ``pci0000:00`` are not)."""
    return PCI_ADDR_RE.fullmatch(name) is not None


def card_in_group(addr: str, group: int) -> str:
    """``0000:01:00.0 (IOMMU group 13)`` as the text outputs name a card, or ``(no IOMMU
    group)`` where the IOMMU is off: the JSON's ``-1`` is a placeholder, not a group."""
    return f"{addr} (IOMMU group {group})" if group >= 0 else f"{addr} (no IOMMU group)"


def canonical_addr(text: str) -> str | None:
    """The one parser of user-given addresses: the sysfs spelling of ``text``, or None.

    Hex of either case; a domain of 4 to 8 digits, written the way the kernel names it
    (``%04x``: ``0000``, ``10000``; a padded ``00010000`` becomes ``10000``). Strict
    otherwise: no surrounding space, no trailing newline, no short ``BB:DD.F`` form.
    """
    m = _PCI_ADDR_LOOSE_RE.fullmatch(text)
    if m is None:
        return None
    domain, bus, slot, function = m.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{slot.lower()}.{function}"


ADDR_FORMAT = "DDDD:BB:DD.F, hex, a domain of 4 to 8 digits"


def parse_addr(text: str) -> str:
    """`canonical_addr`, or the one `UsageError` every entry point gives for a bad address."""
    addr = canonical_addr(text)
    if addr is None:
        raise UsageError(f"{text!r} is not a PCI address ({ADDR_FORMAT})")
    return addr


def parse_vendor(text: str) -> str:
    """``0x10DE``, ``10de`` → ``0x10de``; anything else is a `UsageError`."""
    m = VENDOR_RE.fullmatch(text)
    if m is None:
        raise UsageError(f"{text!r} is not a PCI vendor id (0x10de)")
    return "0x" + m.group(1).lower()


def is_driver_name(name: str) -> bool:
    return DRIVER_NAME_RE.fullmatch(name) is not None and name not in (".", "..")


#: A vendor or device id, and a class code, in any spelling of their hex digits.
_ID_TEXT_RE = re.compile(r"(?:0[xX])?([0-9a-fA-F]{4})")
_CLASS_TEXT_RE = re.compile(r"(?:0[xX])?([0-9a-fA-F]{6})")


def pci_id(raw: str) -> str:
    """A ``vendor`` or ``device`` file's text in the kernel's spelling, ``0x`` and four
    lower-case hex digits: ``0x10de`` as the kernel writes it, and from a copy that spelled
    it otherwise (``0x10DE``, ``10de``); any other text as written."""
    if raw[:2] == "0x" and len(raw) == 6 and raw.islower():
        return raw  # the kernel's own spelling (the common case): no regex
    m = _ID_TEXT_RE.fullmatch(raw)
    return "0x" + m.group(1).lower() if m is not None else raw


def class_prefix(raw: str) -> str:
    """``"0x030000"`` → ``"0x0300"`` (also from ``0X030000`` or ``030000``: six hex digits in
    any spelling); other text: its first six characters, ``""`` when missing or shorter."""
    raw = raw.strip()
    m = _CLASS_TEXT_RE.fullmatch(raw)
    if m is not None:
        return "0x" + m.group(1)[:4].lower()
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


#: The attributes sysfs makes of what the kernel read from a function's config space when it
#: added the function (`config_attr`): a capture that dropped them may still hold ``config``.
CONFIG_ATTRS = frozenset(("vendor", "device", "class", "revision", "subsystem_vendor",
                          "subsystem_device", "modalias"))
#: Config space: vendor and device ids, class and revision, header type, type 0's subsystem
#: ids, the capability list (its bit in the status register, its first pointer), CardBus's
#: subsystem ids, and the Subsystem ID capability a bridge may carry.
_STATUS, _STATUS_CAP_LIST, _HEADER_TYPE, _SUBSYS_0, _CAP_PTR, _SUBSYS_2 = (
    0x06, 0x10, 0x0E, 0x2C, 0x34, 0x40)
_CAP_ID_SSVID = 0x0D
_MODALIAS = "pci:v{:08X}d{:08X}sv{:08X}sd{:08X}bc{:02X}sc{:02X}i{:02X}"


def _u16(config: bytes, at: int) -> int | None:
    return int.from_bytes(config[at:at + 2], "little") if len(config) >= at + 2 else None


def _subsystem(config: bytes) -> tuple[int, int] | None:
    """The subsystem (vendor, device) the kernel takes from config space for its header type
    (`pci_setup_device`): type 0's at 0x2c, CardBus's at 0x40, a bridge's from its Subsystem
    ID capability (0, 0 without one); None when ``config`` is too short to tell (a read as
    non-root gets 64 bytes)."""
    kind = config[_HEADER_TYPE] & 0x7F
    at: int | None = None
    if kind == 0:
        at = _SUBSYS_0
    elif kind == 2:
        at = _SUBSYS_2
    elif kind == 1:
        status = _u16(config, _STATUS) or 0
        if status & _STATUS_CAP_LIST and len(config) <= _CAP_PTR:
            return None  # a capture cut short before the capability pointer
        at = -1  # no capability: the kernel's 0, 0
        pos = config[_CAP_PTR] & 0xFC if status & _STATUS_CAP_LIST else 0
        for _ in range(48):  # the kernel's bound on a capability chain
            if pos < 0x40:
                break
            if pos + 2 > len(config):
                return None  # the chain leads past what was read
            if config[pos] == 0xFF:
                break
            if config[pos] == _CAP_ID_SSVID:
                at = pos + 4
                break
            pos = config[pos + 1] & 0xFC
    else:
        return None
    if at < 0:
        return 0, 0
    vendor, device = _u16(config, at), _u16(config, at + 2)
    return None if vendor is None or device is None else (vendor, device)


def config_attr(config: bytes, name: str) -> str:
    """Attribute ``name`` (one of `CONFIG_ATTRS`) as sysfs shows it, made from the bytes of
    the function's ``config`` file the way the kernel makes it when it adds the function
    (``0x10de``, class ``0x030000``, revision ``0xa1``, ``modalias``); ``""`` when those bytes
    do not hold it: too short, or no device answered (vendor 0xffff or 0)."""
    if len(config) < 0x10:
        return ""
    vendor, device = _u16(config, 0) or 0, _u16(config, 2) or 0
    if vendor in (0, 0xFFFF):
        return ""
    klass = int.from_bytes(config[9:12], "little")
    if name == "vendor":
        return f"0x{vendor:04x}"
    if name == "device":
        return f"0x{device:04x}"
    if name == "class":
        return f"0x{klass:06x}"
    if name == "revision":
        return f"0x{config[8]:02x}"
    subsystem = _subsystem(config)
    if subsystem is None:
        return ""
    if name == "subsystem_vendor":
        return f"0x{subsystem[0]:04x}"
    if name == "subsystem_device":
        return f"0x{subsystem[1]:04x}"
    if name == "modalias":
        return _MODALIAS.format(vendor, device, *subsystem, klass >> 16, klass >> 8 & 0xFF,
                                klass & 0xFF)
    return ""
