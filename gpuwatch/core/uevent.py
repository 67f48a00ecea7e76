"""The one shape every event source produces: a kernel uevent as its property map.

Sources (netlink, a JSONL file, a simulated kernel) all reduce to this, so the model
and the watcher never know where an event came from.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

KNOWN_ACTIONS = frozenset({"add", "remove", "change", "move", "bind", "unbind"})


_NO_PROPERTIES: Mapping[str, str] = MappingProxyType({})


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

    @property
    def normalized_action(self) -> str:
        """Unknown actions behave like ``change``: sysfs is the truth, the word only says 'look'."""
        return self.action if self.action in KNOWN_ACTIONS else "change"
