"""Lay out a device recording taken on a real machine as the sysfs tree the kernel showed there.

Two text formats share one shape, a blank-line separated record per device that starts with
``P: <devpath>``:

* ``udevadm info --export-db``: ``E:`` lines are the device's properties (the kernel's uevent
  plus what udev rules added), ``N:`` its ``/dev`` name, ``S:`` its ``/dev`` links and ``L:``
  a link *priority* (a number, no ``=``).
* ``umockdev-record``: the same plus ``A: name=value`` attributes (``\\n`` and other C escapes),
  ``H: name=HEX`` binary attributes and ``L: name=target`` sysfs links (``driver``,
  ``subsystem``, ``iommu_group``).

Both formats leave folders out that only glue devices together (``pci0000:00``, ``drm``); they
are made. An export-db holds no attributes, so a PCI function's ``vendor``, ``device``,
``subsystem_*`` and ``class`` are written from ``PCI_ID``, ``PCI_SUBSYS_ID`` and ``PCI_CLASS``,
the kernel's own uevent spelling of the same values; an attribute a recording holds is never
replaced. What neither format records (``boot_vga`` in an export-db, IOMMU groups) is absent,
as it would be from a kernel that has none.

Links are made the way sysfs spells them (relative, never followed): ``subsystem``,
``driver`` (and the driver's link back), ``device`` of a class device, the
``bus/<bus>/devices`` and ``class/<class>`` entries. ``/dev`` nodes are empty files.
"""

from __future__ import annotations

import gzip
import os
import re
from dataclasses import dataclass, field

from gpuwatch.errors import UsageError
from gpuwatch.testing.sysroot import SysRoot, _kernel_rel, _write

#: Properties the kernel itself puts in a device's ``uevent`` file; the rest are udev's.
_KERNEL_PROPS = re.compile(
    r"^(DRIVER|MODALIAS|MAJOR|MINOR|DEVNAME|DEVTYPE|DEVMODE|DEVUID|DEVGID|PCI_[A-Z_]+|OF_[A-Z_]+"
    r"|INTERFACE|PRODUCT|TYPE|BUSNUM|DEVNUM|NR_[A-Z_]+)$")
#: Subsystems that are buses (``bus/<name>``); every other one is a class (``class/<name>``).
_BUSES = frozenset({"pci", "usb", "platform", "acpi", "i2c", "spi", "pci_express", "pnp",
                    "serio", "hid", "scsi", "virtio", "vmbus", "auxiliary", "cpu", "node",
                    "event_source", "nvmem", "mdio_bus", "thunderbolt", "xen", "mei"})
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|[0-7]{1,3}|.)", re.DOTALL)
_SIMPLE = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "a": "\a", "b": "\b", "f": "\f",
           "v": "\v", '"': '"', "'": "'"}


class RecordingError(UsageError):
    """The recording is not of the form above (a record without ``P:``, a path that leaves
    ``/devices``, a subsystem or driver that is no plain name, a malformed line)."""


@dataclass
class Record:
    """One device of a recording."""

    devpath: str
    props: dict[str, str] = field(default_factory=dict)
    attrs: dict[str, bytes] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    node: str | None = None

    @property
    def subsystem(self) -> str | None:
        target = self.links.get("subsystem")
        return target.rsplit("/", 1)[-1] if target else self.props.get("SUBSYSTEM")

    @property
    def name(self) -> str:
        return self.devpath.rsplit("/", 1)[-1]


def _unescape(text: str) -> bytes:
    """umockdev's C escapes (``\\n``, ``\\\\``, ``\\xHH``, octal) back to bytes."""

    def one(m: re.Match[str]) -> str:
        code = m.group(1)
        if code[0] == "x" and len(code) == 3:
            return chr(int(code[1:], 16))
        if code[0] in "01234567":
            return chr(int(code, 8))
        return _SIMPLE.get(code, "\\" + code)

    return _ESCAPE.sub(one, text).encode("latin-1", "surrogateescape")


def _safe_rel(path: str, what: str) -> str:
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise RecordingError(f"{what} is not a plain relative path: {path!r}")
    return path


def _one_name(name: str, what: str) -> str:
    """A subsystem's or driver's name: one folder of ``sys/bus`` or ``sys/class``, which it
    is written as (``sys/class/<name>/<device>``), never a path that leads elsewhere."""
    if name in ("", ".", "..") or "/" in name or "\0" in name:
        raise RecordingError(f"{what} is not a plain name: {name!r}")
    return name


def parse(text: str) -> list[Record]:
    """The records of an export-db dump or a umockdev recording, in their order."""
    records: list[Record] = []
    current: Record | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip("\r")
        if not line.strip():
            current = None
            continue
        if line.startswith("#") or line[:1].isspace() or len(line) < 3 or line[1:3] != ": ":
            continue  # comments, continuation lines and headers of other tools
        tag, value = line[0], line[3:]
        if tag == "P":
            if not value.startswith("/devices/"):
                raise RecordingError(f"line {number}: device path not under /devices: {value!r}")
            _safe_rel(value[len("/devices/"):], f"line {number}: device path")
            current = Record(devpath=value)
            records.append(current)
            continue
        if current is None:
            raise RecordingError(f"line {number}: {tag}: line outside a record")
        name, eq, rest = value.partition("=")
        if tag == "E" and eq:
            current.props[name] = rest
        elif tag == "A" and eq:
            current.attrs[_safe_rel(name, f"line {number}: attribute")] = _unescape(rest)
        elif tag == "H" and eq:
            try:
                current.attrs[_safe_rel(name, f"line {number}: attribute")] = bytes.fromhex(rest)
            except ValueError as exc:
                raise RecordingError(f"line {number}: attribute {name!r} is no hex") from exc
        elif tag == "L" and eq:  # umockdev's link; export-db's "L: 0" is a priority
            current.links[_safe_rel(name, f"line {number}: link")] = rest
        elif tag == "N":
            current.node = value.partition("=")[0]
    return records


def read_recording(path: str | os.PathLike[str]) -> list[Record]:
    """`parse` of a file, gzip-compressed when its name ends in ``.gz``."""
    with open(path, "rb") as f:
        raw = f.read()
    if os.fspath(path).endswith(".gz"):
        raw = gzip.decompress(raw)
    return parse(raw.decode("utf-8", "surrogateescape"))


def _pci_attrs(props: dict[str, str]) -> dict[str, bytes]:
    """A PCI function's identity attributes as the kernel prints them, from its uevent."""
    out: dict[str, bytes] = {}
    try:
        if "PCI_ID" in props:
            ven, dev = (int(x, 16) for x in props["PCI_ID"].split(":"))
            out["vendor"], out["device"] = b"0x%04x\n" % ven, b"0x%04x\n" % dev
        if "PCI_SUBSYS_ID" in props:
            sven, sdev = (int(x, 16) for x in props["PCI_SUBSYS_ID"].split(":"))
            out["subsystem_vendor"] = b"0x%04x\n" % sven
            out["subsystem_device"] = b"0x%04x\n" % sdev
        if "PCI_CLASS" in props:
            out["class"] = b"0x%06x\n" % int(props["PCI_CLASS"], 16)
    except ValueError as exc:
        raise RecordingError(f"malformed PCI ids in {props.get('PCI_SLOT_NAME')}") from exc
    return out


def _uevent(props: dict[str, str]) -> bytes:
    lines = []
    for key, value in props.items():
        if _KERNEL_PROPS.match(key):
            if key == "DEVNAME":
                value = value.removeprefix("/dev/")
            lines.append(f"{key}={value}\n")
    return "".join(lines).encode("utf-8", "surrogateescape")


class _Tree:
    """Writes under one root; every link relative, as sysfs spells it."""

    def __init__(self, root: str) -> None:
        self.root = root

    def abs(self, rel: str) -> str:
        return self.root + "/" + rel

    def link(self, target: str, link: str) -> None:
        os.makedirs(os.path.dirname(self.abs(link)), exist_ok=True)
        if not os.path.lexists(self.abs(link)):
            os.symlink(_kernel_rel(target, link), self.abs(link))

    def file(self, rel: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(self.abs(rel)), exist_ok=True)
        if os.path.islink(self.abs(rel)):
            raise RecordingError(f"attribute over a link: {rel}")
        _write(self.abs(rel), data)

    def glue(self, devpath: str) -> None:
        """The folders down to ``devpath``; a root bus (``pci0000:00``) gets its ``uevent``."""
        rel = "sys" + devpath
        os.makedirs(self.abs(rel), exist_ok=True)
        parts = devpath.split("/")
        for depth in range(3, len(parts) + 1):
            folder = "sys" + "/".join(parts[:depth])
            if re.fullmatch(r"pci[0-9a-f]{4,8}:[0-9a-f]{2}", parts[depth - 1]) and not (
                    os.path.lexists(self.abs(folder + "/uevent"))):
                _write(self.abs(folder + "/uevent"), b"")


def _link_target(record: Record, name: str, target: str) -> str:
    """A recorded link's target, root-relative; it must stay under ``sys``."""
    base = ("sys" + record.devpath).split("/")
    for part in target.split("/"):
        if part == "..":
            if len(base) <= 1:
                raise RecordingError(f"{record.devpath}: link {name} leaves sys: {target!r}")
            base.pop()
        elif part not in ("", "."):
            base.append(part)
    return "/".join(base)


def lay_out(records: list[Record], root: str | os.PathLike[str]) -> SysRoot:
    """Write ``records`` under ``root`` as sysfs and ``/dev`` show them; returns the
    `SysRoot` of that folder (its base folders made, nothing of the machine in its model)."""
    sysroot = SysRoot(root)
    tree = _Tree(str(sysroot.root))
    known = {r.devpath for r in records}
    for record in records:
        rel = "sys" + record.devpath
        tree.glue(record.devpath)
        subsystem = record.subsystem
        if subsystem is not None:
            _one_name(subsystem, f"{record.devpath}: subsystem")
        attrs = dict(record.attrs)
        if subsystem == "pci":
            attrs = {**_pci_attrs(record.props), **attrs}
        if "MAJOR" in record.props and "MINOR" in record.props:
            attrs.setdefault("dev", f"{record.props['MAJOR']}:{record.props['MINOR']}\n".encode())
        attrs.setdefault("uevent", _uevent(record.props))
        for name, data in attrs.items():
            tree.file(f"{rel}/{name}", data)
        links = dict(record.links)
        kind = "bus" if subsystem in _BUSES else "class"
        if subsystem and "subsystem" not in links:
            tree.link(f"sys/{kind}/{subsystem}", f"{rel}/subsystem")
        for name, target in links.items():
            tree.link(_link_target(record, name, target), f"{rel}/{name}")
        if subsystem:
            listed = (f"sys/bus/{subsystem}/devices/{record.name}" if kind == "bus"
                      else f"sys/class/{subsystem}/{record.name}")
            tree.link(rel, listed)
        driver = record.props.get("DRIVER")
        if driver and "driver" not in links and kind == "bus":
            _one_name(driver, f"{record.devpath}: driver")
            tree.link(f"sys/bus/{subsystem}/drivers/{driver}", f"{rel}/driver")
        if os.path.islink(tree.abs(f"{rel}/driver")):
            drv = os.path.realpath(tree.abs(f"{rel}/driver"))
            if drv.startswith(tree.root + "/sys/bus/"):
                os.makedirs(drv, exist_ok=True)
                tree.link(rel, os.path.relpath(drv, tree.root) + "/" + record.name)
        group = links.get("iommu_group")
        if group is not None:
            grel = _link_target(record, "iommu_group", group)
            tree.link(rel, f"{grel}/devices/{record.name}")
        if kind == "class" and "device" not in links:
            parent = record.devpath.rsplit("/", 1)[0]
            while parent.count("/") > 1 and parent not in known:
                parent = parent.rsplit("/", 1)[0]
            if parent in known:
                tree.link("sys" + parent, f"{rel}/device")
        node = record.node or record.props.get("DEVNAME", "").removeprefix("/dev/") or None
        if node and not node.startswith("/"):
            sysroot.add_dev_node("dev/" + _safe_rel(node, f"{record.devpath}: node"))
    return sysroot
