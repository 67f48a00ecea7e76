"""Poisoned groups: the record that a switch of a group wedged, kept until the next boot.

A wedged unbind leaves a task stuck in the kernel holding the device lock; any further
bind, unbind or even some reads of that device add another stuck task. So the group is
refused from then on. The record must outlive the process (a restarted watcher must not try
again) but not the boot (a reboot frees the device): it is a small JSON file keyed by the
kernel's boot id, and an entry written under another boot id counts as absent.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

from gpuwatch.hostfs.files import read_attr, read_bytes

#: Default location, under the host root (tests keep it inside their tmp root).
DEFAULT_POISON_FILE = "var/lib/gpuwatch/poison.json"
BOOT_ID_FILE = "proc/sys/kernel/random/boot_id"
#: The file holds a few entries; one longer than this is not ours.
POISON_MAX_BYTES = 1 << 20
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
        self.path = os.fspath(path) if path is not None else os.path.join(
            self.root, DEFAULT_POISON_FILE)

    def boot_id(self) -> str:
        return read_attr(os.path.join(self.root, BOOT_ID_FILE))

    def _read(self) -> dict[str, Any]:
        # read_bytes: a FIFO or device planted here is refused at once, never waited on.
        try:
            data = json.loads(read_bytes(self.path, POISON_MAX_BYTES))
        except (OSError, ValueError, RecursionError):
            return {}
        return data if isinstance(data, dict) else {}

    def load(self) -> dict[int, PoisonEntry]:
        """This boot's poisoned groups; entries of another boot are ignored."""
        data = self._read()
        if data.get("boot_id") != self.boot_id():
            return {}
        out: dict[int, PoisonEntry] = {}
        groups = data.get("groups")
        if not isinstance(groups, dict):
            return out
        for key, raw in groups.items():
            if not (isinstance(key, str) and _GROUP_KEY_RE.fullmatch(key)
                    and isinstance(raw, dict)):
                continue
            out[int(key)] = PoisonEntry(
                addr=str(raw.get("addr", "")), to_mode=str(raw.get("to_mode", "")),
                error=str(raw.get("error", "")), time=str(raw.get("time", "")),
            )
        return out

    def _store(self, entries: dict[int, PoisonEntry]) -> None:
        data = {"boot_id": self.boot_id(),
                "groups": {str(g): asdict(e) for g, e in sorted(entries.items())}}
        folder = os.path.dirname(self.path) or "."
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".poison.", dir=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(data, fh, indent=1)
                fh.write("\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def add(self, group: int, entry: PoisonEntry) -> None:
        entries = self.load()
        entries[group] = entry
        self._store(entries)

    def clear(self, group: int) -> bool:
        """Forget a group; True when it was poisoned in this boot."""
        entries = self.load()
        if group not in entries:
            return False
        del entries[group]
        self._store(entries)
        return True


__all__ = ["BOOT_ID_FILE", "DEFAULT_POISON_FILE", "PoisonEntry", "PoisonStore"]
