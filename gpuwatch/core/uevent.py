"""The one shape every event source produces: a kernel uevent as its property map.

Sources (netlink, a JSONL file, a simulated kernel) all reduce to this, so the model
and the watcher never know where an event came from.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

#: udevd's messages start with this magic; the kernel's with ``ACTION@DEVPATH``.
UDEV_MAGIC = b"libudev\0"
#: The rest of udevd's header (systemd's ``monitor_netlink_header``): the version magic,
#: big-endian, then the header's size and the properties' offset and length, host order.
_UDEV_HEADER = struct.Struct("=4sIII")
_UDEV_VERSION = (0xFEEDCAFE).to_bytes(4, "big")
_SUBSYSTEM_KEY = b"\0SUBSYSTEM="


_NO_PROPERTIES: Mapping[str, str] = MappingProxyType({})
_tuple_new = tuple.__new__


class UEvent(NamedTuple):
    """One kernel uevent. ``properties`` holds everything the kernel sent, verbatim.

    Immutable and cheap to build (a NamedTuple): a storm makes tens of thousands a second.
    """

    action: str
    devpath: str
    subsystem: str
    properties: Mapping[str, str] = _NO_PROPERTIES

    @classmethod
    def from_properties(cls, props: Mapping[str, str]) -> UEvent:
        """Build from a raw property map (``ACTION``, ``DEVPATH``, ``SUBSYSTEM``, …).

        Missing keys become ``""`` rather than errors: a source must never die on a
        malformed event, and the model treats an empty DEVPATH as naming nothing.
        """
        clean = {str(k): str(v) for k, v in props.items()}
        return cls(
            action=clean.get("ACTION", ""),
            devpath=clean.get("DEVPATH", ""),
            subsystem=clean.get("SUBSYSTEM", ""),
            properties=MappingProxyType(clean),
        )

    def get(self, key: str, default: str = "") -> str:
        return self.properties.get(key, default)

    def to_properties(self) -> dict[str, str]:
        """The property map as the kernel sent it (what ``gpuwatch record`` writes)."""
        props = dict(self.properties)
        props.setdefault("ACTION", self.action)
        props.setdefault("DEVPATH", self.devpath)
        props.setdefault("SUBSYSTEM", self.subsystem)
        return props


def subsystem_of(data: bytes) -> bytes | None:
    """The ``SUBSYSTEM`` value of a raw kernel uevent, found without parsing the rest.

    The cheap prefix test that lets a source drop the uevents of the subsystems it does not
    follow (most of a busy host's traffic) before building anything from them.
    """
    start = data.find(_SUBSYSTEM_KEY)
    if start < 0:
        return None
    start += len(_SUBSYSTEM_KEY)
    end = data.find(b"\0", start)
    return data[start:] if end < 0 else data[start:end]


def parse_kernel_uevent(data: bytes) -> UEvent | None:
    """One kernel netlink message, ``ACTION@DEVPATH\\0KEY=VALUE\\0…``, as a `UEvent`.

    ``None`` for anything that is not a kernel uevent (a udevd message, no ``@`` header).
    Bytes that are not UTF-8 survive as surrogate escapes, so a DEVPATH still names the
    same sysfs path when handed back to ``os`` functions. Entries without ``=`` are
    skipped, and the first of a repeated key counts (as in `subsystem_of`); the properties
    win over the header when both name the action or path.
    """
    if data.startswith(UDEV_MAGIC):
        return None
    text = data.decode("utf-8", "surrogateescape")
    parts = text.split("\0")
    action, at, devpath = parts[0].partition("@")
    if not at:
        return None
    props: dict[str, str] = {}
    for part in parts[1:]:
        key, eq, value = part.partition("=")
        if eq and key and key not in props:
            props[key] = value
    action = props.setdefault("ACTION", action)
    devpath = props.setdefault("DEVPATH", devpath)
    # UEvent(...) without the NamedTuple's Python-level __new__: one per kernel message.
    return _tuple_new(UEvent, (action, devpath, props.get("SUBSYSTEM", ""),
                               MappingProxyType(props)))


def parse_udev_message(data: bytes) -> UEvent | None:
    """One message as udevd multicasts it (the ``libudev`` header, then ``KEY=VALUE\\0``
    properties at the offset it gives) as a `UEvent`, read as libudev reads it.

    ``None`` for anything else (a kernel message, another version, a header pointing
    outside the message). For the udev source's drain after a loss, which reads the raw
    socket: pyudev parses what is read through it.
    """
    if not data.startswith(UDEV_MAGIC) or len(data) < len(UDEV_MAGIC) + _UDEV_HEADER.size:
        return None
    version, _size, offset, _length = _UDEV_HEADER.unpack_from(data, len(UDEV_MAGIC))
    if version != _UDEV_VERSION or offset + 32 > len(data):  # libudev's own bound
        return None
    props: dict[str, str] = {}
    for part in data[offset:].decode("utf-8", "surrogateescape").split("\0"):
        key, eq, value = part.partition("=")
        if eq and key and key not in props:
            props[key] = value
    if "ACTION" not in props or "DEVPATH" not in props:
        return None
    return UEvent(props["ACTION"], props["DEVPATH"], props.get("SUBSYSTEM", ""),
                  MappingProxyType(props))
