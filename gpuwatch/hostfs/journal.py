"""The record of a switch under way, so that one whose process died half-way is known.

A switch that is interrupted (SIGTERM, a cancelled caller) ends itself: it puts the group
back and publishes ``switch-failed``. One whose process is killed outright (SIGKILL, an OOM
kill, a crash) runs nothing more: its group may be left split across drivers, a function
pinned by a ``driver_override`` nobody clears, and its log ends in a ``switch-started`` with
no end. So a switch writes ``<root>/run/gpuwatch/switch-<key>.json`` before it begins and
removes it once its end is published: a file found while nobody holds the group's switch
lock is a switch that never ended. The next watcher to start and the next switch of the
group say so (a ``switch-failed``, ``"error": "abandoned: …"``); the next switch to vfio
(``recover`` too) clears the overrides it may have left. Keyed by the boot id, as the poison
file: a reboot drops every override, and a record of another boot counts as absent.

The key is the group's number when the switch began; a card removed and added again may
come back under another (and a no-IOMMU group comes and goes with vfio-pci). So a record is
the group's whose recorded members are among its functions now, whatever its key, and one
under the group's number naming none of them is another card's (`gpuwatch.switch.engine`).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass, replace
from typing import TypeGuard

from gpuwatch.core.modes import MODES
from gpuwatch.core.pci import is_pci_addr
from gpuwatch.core.plan import PoisonKey
from gpuwatch.hostfs.bootstate import boot_id, read_record, write_record
from gpuwatch.hostfs.files import flock_holders, list_dir, place_in_root

_PREFIX, _SUFFIX = "switch-", ".json"
#: The range of a pid (``pid_t``) and of an IOMMU group number (-1: none) in a record.
_INT_MIN, _INT_MAX = -(1 << 31), (1 << 31) - 1
#: Where the switch locks and these records are, under the host root.
LOCK_DIR = "run/gpuwatch"


@dataclass(frozen=True, slots=True)
class Journal:
    """One switch under way (or abandoned): what it set out to do, and who ran it."""

    addr: str
    group: int
    from_mode: str
    to_mode: str
    members: tuple[str, ...]
    pid: int
    started: str
    #: A ``switch-failed`` already said it was abandoned (the cleanup may still be due).
    reported: bool = False


def journal_path(folder: str, key: PoisonKey) -> str:
    return os.path.join(folder, f"{_PREFIX}{key}{_SUFFIX}")


def write_journal(folder: str, key: PoisonKey, boot: str, journal: Journal) -> None:
    """Write (replace atomically) the record; `OSError` to the caller."""
    write_record(journal_path(folder, key), {"boot_id": boot, **asdict(journal)})


def read_journal(folder: str, key: PoisonKey, boot: str) -> Journal | None:
    """The record of this boot for ``key``, or None (none, another boot's, garbage).

    Garbage is anything `write_journal` never writes: a field missing or of another type
    (``"pid": Infinity``, a number past a ``pid_t``, a member that is no PCI address, a
    mode that is none), which would otherwise stop every switch of the host, and the
    daemon's start, with an internal error."""
    data = read_record(journal_path(folder, key), boot)
    addr, group, pid = data.get("addr"), data.get("group"), data.get("pid")
    from_mode, to_mode, started = data.get("from_mode"), data.get("to_mode"), data.get("started")
    members = data.get("members")
    if not (isinstance(addr, str) and is_pci_addr(addr) and _small_int(group)
            and _small_int(pid) and isinstance(from_mode, str)
            and isinstance(to_mode, str) and to_mode in MODES
            and isinstance(started, str) and isinstance(members, list)
            and all(isinstance(m, str) and is_pci_addr(m) for m in members)):
        return None
    return Journal(addr=addr, group=group, from_mode=from_mode, to_mode=to_mode,
                   members=tuple(members), pid=pid, started=started,
                   reported=data.get("reported") is True)


def _small_int(value: object) -> TypeGuard[int]:
    """An integer as a record holds a pid or a group number (no bool, float or bignum)."""
    return type(value) is int and _INT_MIN <= value <= _INT_MAX


def mark_reported(folder: str, key: PoisonKey, boot: str, journal: Journal) -> None:
    """Remember that its abandonment was published (best effort: a failure repeats it).
    Only while the file still holds that record: a watcher reports without the group's
    lock, and a switch begun since has written its own, which marking would overwrite with
    the old one (were that switch killed too, its end would never be told)."""
    with contextlib.suppress(OSError):
        if read_journal(folder, key, boot) == journal:
            write_journal(folder, key, boot, replace(journal, reported=True))


def remove_journal(folder: str, key: PoisonKey) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(journal_path(folder, key))


def discard_journal(folder: str, key: PoisonKey, boot: str, journal: Journal) -> None:
    """Remove the record of ``key`` while the file still holds ``journal`` (marked reported
    since or not), without that key's lock: a switch of that key begun since has written its
    own, which stays (best effort)."""
    with contextlib.suppress(OSError):
        now = read_journal(folder, key, boot)
        if now is not None and replace(now, reported=False) == replace(journal, reported=False):
            remove_journal(folder, key)


def move_journal(folder: str, key: PoisonKey, new_key: PoisonKey) -> bool:
    """Give the record of ``key`` the name of ``new_key``, unless a record has that name;
    whether it moved (a hard link, then the old name goes: never a copy over another)."""
    try:
        os.link(journal_path(folder, key), journal_path(folder, new_key), follow_symlinks=False)
    except OSError:
        return False
    remove_journal(folder, key)
    return True


def journal_keys(folder: str) -> list[PoisonKey]:
    """The keys of every record in ``folder``: group numbers as `journal_path` writes them
    (ASCII decimal), or card addresses. Any other name (``switch-².json``, whose "digit"
    ``int`` refuses, ``switch-013.json``) is not a record of ours, and is left alone."""
    keys: list[PoisonKey] = []
    for name in sorted(list_dir(folder)):
        if name.startswith(_PREFIX) and name.endswith(_SUFFIX):
            key = name[len(_PREFIX):-len(_SUFFIX)]
            if key.isascii() and key.isdigit() and len(key) <= 10 and str(int(key)) == key:
                keys.append(int(key))
            elif is_pci_addr(key):
                keys.append(key)
    return keys


def process_gone(pid: int) -> bool:
    """Whether no process ``pid`` exists here (a live one, or one we may not signal, is
    not gone: in doubt, the record is left for the next switch, which holds the lock)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def lock_held(folder: str, key: PoisonKey | None) -> bool:
    """Whether a process holds the switch lock of ``key`` (None: the host lock) alone, seen
    in ``/proc/locks`` without taking it (taking it, even for a moment, would make a switch
    starting then fail as busy). Unreadable (no privilege): no one is seen."""
    path = os.path.join(folder, "switch.lock" if key is None else f"switch-{key}.lock")
    try:
        st = os.stat(path, follow_symlinks=False)
        return next(flock_holders(st, exclusive=True), None) is not None
    except (OSError, ValueError):
        return False


def find_abandoned(root: str, key: PoisonKey) -> Journal | None:
    """The record of a switch of ``key`` whose process is gone without ending it (this
    boot's, its lock held by nobody), seen without the lock; None when there is none, or its
    switch may still be running.

    The record is read before the lock is looked at, and again after: a switch removes its
    record before it lets go of the lock, so a record there while nobody holds the lock is
    one its process left. Looked at the other way round, a switch starting between the two
    looks was taken for abandoned whenever its pid named no process here (another PID
    namespace)."""
    folder, boot = place_in_root(root, LOCK_DIR), boot_id(root)
    left = read_journal(folder, key, boot)
    if left is None or lock_held(folder, key) or read_journal(folder, key, boot) != left:
        return None
    if left.pid == os.getpid() or not process_gone(left.pid):
        return None
    return left


__all__ = [
    "LOCK_DIR",
    "Journal",
    "discard_journal",
    "find_abandoned",
    "journal_keys",
    "journal_path",
    "lock_held",
    "mark_reported",
    "move_journal",
    "process_gone",
    "read_journal",
    "remove_journal",
    "write_journal",
]
