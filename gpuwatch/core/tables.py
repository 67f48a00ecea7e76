"""The lookup tables (device patterns, GPU vendors, PCI class labels) as one frozen value.

Pure: validation only. Where the tables come from (the embedded YAML, an override file) is
`gpuwatch.settings`' business, so the model can hold tables without reading a file.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from gpuwatch.core.tabledata import TABLE_KEYS, device_id_key, hex_keyed
from gpuwatch.core.tabledata import class_label as _class_label

_DRIVER_NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")


class Tables(BaseModel):
    """The lookup tables every reader and the model share. Immutable once loaded."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device_patterns: tuple[str, ...]
    gpu_vendors: Mapping[str, str]
    pci_class_labels: Mapping[str, str]
    #: vfio-pci variant drivers whose name does not end in ``vfio_pci`` (those are known).
    vfio_variant_drivers: tuple[str, ...] = ()
    #: Drivers of BMC/console functions: a group with one bound to them stays with the host.
    host_console_drivers: tuple[str, ...] = ()
    #: PCI ids (``0x1a03:0x2000``) of BMC/console functions: kept for the host bound or not.
    host_console_devices: tuple[str, ...] = ()

    @field_validator("host_console_devices", mode="before")
    @classmethod
    def _device_ids(cls, value: Any) -> Any:
        if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
            return value  # refused as not a list by the field's own type
        return tuple(device_id_key(v) for v in value)

    @field_validator("vfio_variant_drivers", "host_console_drivers")
    @classmethod
    def _driver_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if not _DRIVER_NAME_RE.fullmatch(name) or name in (".", ".."):
                raise ValueError(f"{name!r} is not a driver name ([A-Za-z0-9_.-]+)")
        return value

    @field_validator("device_patterns")
    @classmethod
    def _absolute_dev_paths(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for pattern in value:
            if not pattern.startswith("/dev/"):
                raise ValueError(f"pattern {pattern!r} must start with /dev/")
            if any(part in (".", "..") for part in pattern.split("/")):
                # `/dev/../etc/passwd`: a pattern names device nodes, in /dev, nothing else.
                raise ValueError(f"pattern {pattern!r} must stay in /dev/ (no . or .. parts)")
        return value

    @field_validator("gpu_vendors", "pci_class_labels", mode="before")
    @classmethod
    def _normalise_hex_keys(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            return value
        return hex_keyed(value)

    def class_label(self, klass: str) -> str:
        return _class_label(self.pci_class_labels, klass)


__all__ = ["TABLE_KEYS", "Tables"]
