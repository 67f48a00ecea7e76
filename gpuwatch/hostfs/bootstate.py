"""Small records that hold for one boot: the poison file, and the services a switch stopped.

Both must outlive the process (a restarted watcher, the next ``gpuwatch mode``) but not the
boot (a reboot frees a wedged device, and starts nvidia-persistenced by its own unit). So each
is a JSON object holding the kernel's ``boot_id``; a record of another boot reads as empty.
Writes are atomic (a new file renamed over the old), reads refuse anything but a small
regular file (a FIFO planted there is never waited on) that only root (or the user we run
as) could have written: no link (the record is never one: a link to ``/etc/shadow`` is not
read), no file of another user's or that others may write, none in a directory another user
controls. Root acts on these records (a switch clears the ``driver_override`` of the
functions an abandoned switch's record names), so one another user could forge is absent.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from typing import Any

from gpuwatch.hostfs.files import (
    NotARegularFile,
    in_tree,
    make_dirs,
    place_in_root,
    read_attr,
    read_capped,
    write_atomic,
)
from gpuwatch.ownership import not_ours, others_control, others_may_write

_log = logging.getLogger(__name__)

BOOT_ID_FILE = "proc/sys/kernel/random/boot_id"
#: Such a file holds a few entries; one longer than this is not ours.
RECORD_MAX_BYTES = 1 << 20
#: The services a switch stopped and has not started again (`stopped_services`).
DEFAULT_STOPPED_FILE = "var/lib/gpuwatch/stopped.json"


def boot_id(root: str) -> str:
    return read_attr(in_tree(root, BOOT_ID_FILE))


def read_record(path: str, boot: str) -> dict[str, Any]:
    """The record at ``path`` when it was written in boot ``boot``; else (another boot, no
    file, garbage, a special file, a link, a file another user could have written) ``{}``."""
    try:
        data = json.loads(_read_ours(path))
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(data, dict) or data.get("boot_id") != boot:
        return {}
    return data


def _read_ours(path: str) -> bytes:
    """The bytes of the record at ``path``, if it is a small regular file no one but root
    (or us) could have written; `OSError` otherwise. Looked at before it is opened (a device
    node is never opened: its driver's open would run), opened without following a link,
    and looked at again on the descriptor (a swap in between is caught)."""
    if not stat.S_ISREG(os.lstat(path).st_mode):  # no file at all: FileNotFoundError
        _log.warning("ignoring %s: it is no regular file (a link, a FIFO, a device), which "
                     "gpuwatch never writes there", path)
        raise NotARegularFile(errno.EINVAL, "not a regular file", path)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFile(errno.EINVAL, "not a regular file", path)
        why = not_ours(st) or others_may_write(st)
        where = None if why else others_control(path)
        if why or where:
            _log.warning("ignoring %s: %s, so another user could have written it",
                         path, f"it {why}" if why else where)
            raise OSError(errno.EPERM, "not a record of ours", path)
        return read_capped(fd, RECORD_MAX_BYTES, path)
    finally:
        os.close(fd)


def write_record(path: str, data: dict[str, Any]) -> None:
    """Replace the record at ``path`` atomically; `OSError` (read-only, full) to the caller."""
    # 0755 whatever the umask: a folder others may write (a umask of 0) would make every
    # record in it one another user could have written (`read_record`).
    make_dirs(os.path.dirname(path) or ".")
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
