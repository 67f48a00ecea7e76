"""Poisoned groups: the record that a switch of a group wedged, kept until the next boot.

A wedged unbind leaves a task stuck in the kernel holding the device lock; any further
bind, unbind or even some reads of that device add another stuck task. So the group is
refused from then on. The record must outlive the process (a restarted watcher must not try
again) but not the boot (a reboot frees the device): it is a small JSON file keyed by the
kernel's boot id, and an entry written under another boot id counts as absent.

Entries are keyed by the group number, or, for a card without an IOMMU group, by its
address (`gpuwatch.core.plan.poison_key`). Files written before that held such a card under
``"-1"``; that entry is read as the card its ``addr`` names.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from typing import Any

from gpuwatch.core.pci import PCI_ADDR_RE
from gpuwatch.core.plan import PoisonKey
from gpuwatch.hostfs.bootstate import BOOT_ID_FILE, read_record, write_record
from gpuwatch.hostfs.bootstate import boot_id as read_boot_id
from gpuwatch.hostfs.files import place_in_root

#: Default location, under the host root (tests keep it inside their tmp root).
DEFAULT_POISON_FILE = "var/lib/gpuwatch/poison.json"
#: A group number as `_store` writes it (anything else in the file is ignored).
_GROUP_KEY_RE = re.compile(r"-?[0-9]{1,9}", re.ASCII)


@dataclass(frozen=True, slots=True)
class PoisonEntry:
    addr: str
    to_mode: str
    error: str
    time: str


class PoisonStore:
    """Read and write the poison file. Writes are atomic (a new file renamed over the old)."""

    def __init__(self, root: str, path: str | os.PathLike[str] | None = None) -> None:
        self.root = os.path.abspath(root)
        self.path = os.fspath(path) if path is not None else place_in_root(
            self.root, DEFAULT_POISON_FILE)

    def boot_id(self) -> str:
        return read_boot_id(self.root)

    def _read(self) -> dict[str, Any]:
        return read_record(self.path, self.boot_id())

    def load(self) -> dict[PoisonKey, PoisonEntry]:
        """This boot's poisoned groups (and group-less cards, by address); entries of another
        boot are ignored."""
        data = self._read()
        out: dict[PoisonKey, PoisonEntry] = {}
        groups = data.get("groups")
        if not isinstance(groups, dict):
            return out
        for key, raw in groups.items():
            if not (isinstance(key, str) and isinstance(raw, dict)):
                continue
            entry = PoisonEntry(
                addr=str(raw.get("addr", "")), to_mode=str(raw.get("to_mode", "")),
                error=str(raw.get("error", "")), time=str(raw.get("time", "")),
            )
            if PCI_ADDR_RE.fullmatch(key):
                out[key] = entry
            elif _GROUP_KEY_RE.fullmatch(key):
                group = int(key)
                if group >= 0:
                    out[group] = entry
                elif PCI_ADDR_RE.fullmatch(entry.addr):  # an older file's group-less card
                    out.setdefault(entry.addr, entry)
        return out

    def _store(self, entries: dict[PoisonKey, PoisonEntry]) -> None:
        ordered = sorted(entries.items(), key=lambda kv: (isinstance(kv[0], str),
                                                          kv[0] if isinstance(kv[0], int) else 0,
                                                          str(kv[0])))
        write_record(self.path, {"boot_id": self.boot_id(),
                                 "groups": {str(g): asdict(e) for g, e in ordered}})

    def add(self, key: PoisonKey, entry: PoisonEntry) -> None:
        entries = self.load()
        entries[key] = entry
        self._store(entries)

    def clear(self, key: PoisonKey) -> bool:
        """Forget a group (or group-less card); True when it was poisoned in this boot."""
        entries = self.load()
        if key not in entries:
            return False
        del entries[key]
        self._store(entries)
        return True


__all__ = ["BOOT_ID_FILE", "DEFAULT_POISON_FILE", "PoisonEntry", "PoisonStore"]
