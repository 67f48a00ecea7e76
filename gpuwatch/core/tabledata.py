"""The lookup tables as plain data: their keys and the one spelling of a hex key.

Stdlib only, so a cold direct probe can use the embedded tables without pydantic; the
validated, frozen form is `gpuwatch.core.tables.Tables`, built on these same rules.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

TABLE_KEYS = ("device_patterns", "gpu_vendors", "pci_class_labels", "vfio_variant_drivers",
              "host_console_drivers", "host_console_devices")
#: The tables that map a PCI id to a name (JSON objects); every other one is a list of strings.
KEYED_TABLES = frozenset({"gpu_vendors", "pci_class_labels"})

_ID_RE = re.compile(r"(?:0x)?([0-9a-f]{4}):(?:0x)?([0-9a-f]{4})")


_HEX_RE = re.compile(r"(?:0x)?([0-9a-f]{1,8})")


def hex_key(key: object) -> str:
    """YAML turns an unquoted 0x10de into the int 4318; give the user the key they meant,
    spelled as the model spells ids (``0x10de``; ``10DE`` too). Anything else is no id: a
    key that could never match is refused, not kept to do nothing."""
    if isinstance(key, bool):
        raise ValueError(f"{key!r} is not a hex id")
    if isinstance(key, int) and key >= 0:
        return f"0x{key:04x}"
    match = _HEX_RE.fullmatch(key.strip().lower()) if isinstance(key, str) else None
    if match is None:
        raise ValueError(f"{key!r} is not a hex id (like 0x10de)")
    return "0x" + match.group(1)


def hex_keyed(value: Mapping[Any, Any]) -> dict[str, Any]:
    """A table keyed by PCI ids, every key in `hex_key` spelling. Two spellings of one id
    (``0x10de`` and ``"10DE"``) are one key given twice: refused, not settled silently."""
    out: dict[str, Any] = {}
    spelled: dict[str, object] = {}
    for key, item in value.items():
        name = hex_key(key)
        if name in out:
            raise ValueError(f"{spelled[name]!r} and {key!r} are the same id, {name}")
        out[name], spelled[name] = item, key
    return out


def device_id_key(text: object) -> str:
    """A ``host_console_devices`` entry (``1a03:2000``, ``0x1A03:0x2000``) spelled as the
    model spells a function's ids: ``0x1a03:0x2000``. `ValueError` for anything else."""
    match = _ID_RE.fullmatch(text.strip().lower()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{text!r} is not a PCI vendor:device id (like 1a03:2000)")
    return f"0x{match.group(1)}:0x{match.group(2)}"


def class_label(labels: Mapping[str, str], klass: str) -> str:
    """A PCI class prefix's label, the prefix itself when the table has none."""
    return labels.get(klass, klass)


class TablesView(Protocol):
    """What readers and rules take of the tables: `gpuwatch.core.tables.Tables` (validated,
    from any config) or `TableData` (the embedded ones as they ship)."""

    @property
    def device_patterns(self) -> tuple[str, ...]: ...
    @property
    def gpu_vendors(self) -> Mapping[str, str]: ...
    @property
    def pci_class_labels(self) -> Mapping[str, str]: ...
    @property
    def vfio_variant_drivers(self) -> tuple[str, ...]: ...
    @property
    def host_console_drivers(self) -> tuple[str, ...]: ...
    @property
    def host_console_devices(self) -> tuple[str, ...]: ...


class TableData(NamedTuple):
    """The tables as `Tables` holds them, built without validation: for the embedded ones,
    which a test holds valid and equal to the validated form."""

    device_patterns: tuple[str, ...]
    gpu_vendors: Mapping[str, str]
    pci_class_labels: Mapping[str, str]
    vfio_variant_drivers: tuple[str, ...] = ()
    host_console_drivers: tuple[str, ...] = ()
    host_console_devices: tuple[str, ...] = ()


def table_data(raw: Mapping[str, Any]) -> TableData:
    """``raw`` (the embedded tables' JSON) spelled as `Tables` spells it."""
    return TableData(
        device_patterns=tuple(raw["device_patterns"]),
        gpu_vendors=hex_keyed(raw["gpu_vendors"]),
        pci_class_labels=hex_keyed(raw["pci_class_labels"]),
        vfio_variant_drivers=tuple(raw.get("vfio_variant_drivers", ())),
        host_console_drivers=tuple(raw.get("host_console_drivers", ())),
        host_console_devices=tuple(map(device_id_key, raw.get("host_console_devices", ()))),
    )


def tables_json(tables: TablesView) -> dict[str, Any]:
    """``tables`` as JSON carries them, in the spelling `table_data` reads back (the
    embedded tables' JSON form): the daemon's ``config`` answer gives its tables so, for the
    stdlib reports of a client whose config file is the one the daemon read."""
    return {key: dict(getattr(tables, key)) if key in KEYED_TABLES
            else list(getattr(tables, key)) for key in TABLE_KEYS}


__all__ = ["KEYED_TABLES", "TABLE_KEYS", "TableData", "TablesView", "class_label",
           "device_id_key", "hex_key", "hex_keyed", "table_data", "tables_json"]
