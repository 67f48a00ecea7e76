"""Small records that hold for one boot: the poison file, and the services a switch stopped.

Both must outlive the process (a restarted watcher, the next ``gpuwatch mode``) but not the
boot (a reboot frees a wedged device, and starts nvidia-persistenced by its own unit). So each
is a JSON object holding the kernel's ``boot_id``; a record of another boot reads as empty.
Writes are atomic (a new file renamed over the old), reads refuse anything but a small
regular file (a FIFO planted there is never waited on).
"""

from __future__ import annotations

import json
import os
from typing import Any

from gpuwatch.hostfs.files import in_tree, place_in_root, read_attr, read_bytes, write_atomic

BOOT_ID_FILE = "proc/sys/kernel/random/boot_id"
#: Such a file holds a few entries; one longer than this is not ours.
RECORD_MAX_BYTES = 1 << 20
#: The services a switch stopped and has not started again (`stopped_services`).
DEFAULT_STOPPED_FILE = "var/lib/gpuwatch/stopped.json"


def boot_id(root: str) -> str:
    return read_attr(in_tree(root, BOOT_ID_FILE))


def read_record(path: str, boot: str) -> dict[str, Any]:
    """The record at ``path`` when it was written in boot ``boot``; else (another boot, no
    file, garbage, a special file) ``{}``."""
    try:
        data = json.loads(read_bytes(path, RECORD_MAX_BYTES))
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(data, dict) or data.get("boot_id") != boot:
        return {}
    return data


def write_record(path: str, data: dict[str, Any]) -> None:
    """Replace the record at ``path`` atomically; `OSError` (read-only, full) to the caller."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_atomic(path, json.dumps(data, indent=1) + "\n", 0o600)


def stopped_services(root: str) -> frozenset[str]:
    """The units a switch stopped in this boot and nobody has started again through a
    switch since (``nvidia-persistenced``): the switch back to nvidia starts them."""
    data = read_record(in_tree(root, DEFAULT_STOPPED_FILE), boot_id(root))
    units = data.get("services")
    if not isinstance(units, list):
        return frozenset()
    return frozenset(u for u in units if isinstance(u, str))


def set_service_stopped(root: str, unit: str, stopped: bool) -> None:
    """Remember (or forget) that a switch stopped ``unit``; `OSError` when it cannot be
    written (then the switch back does not start it: the caller says so)."""
    path = place_in_root(root, DEFAULT_STOPPED_FILE)
    units = set(stopped_services(root))
    if (unit in units) == stopped:
        return
    if stopped:
        units.add(unit)
    else:
        units.discard(unit)
    write_record(path, {"boot_id": boot_id(root), "services": sorted(units)})


__all__ = ["BOOT_ID_FILE", "DEFAULT_STOPPED_FILE", "RECORD_MAX_BYTES", "boot_id", "read_record",
           "set_service_stopped", "stopped_services", "write_record"]
