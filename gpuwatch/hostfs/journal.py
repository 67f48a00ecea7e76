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

from gpuwatch.core.plan import PoisonKey
from gpuwatch.hostfs.bootstate import boot_id, read_record, write_record
from gpuwatch.hostfs.files import flock_holders, list_dir, place_in_root

_PREFIX, _SUFFIX = "switch-", ".json"
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
    """The record of this boot for ``key``, or None (none, another boot's, garbage)."""
    data = read_record(journal_path(folder, key), boot)
    members = data.get("members")
    try:
        return Journal(
            addr=str(data["addr"]), group=int(data["group"]), from_mode=str(data["from_mode"]),
            to_mode=str(data["to_mode"]),
            members=tuple(str(m) for m in members) if isinstance(members, list) else (),
            pid=int(data["pid"]), started=str(data["started"]),
            reported=data.get("reported") is True)
    except (KeyError, TypeError, ValueError):
        return None


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
    """The keys of every record in ``folder`` (group numbers, or addresses)."""
    keys: list[PoisonKey] = []
    for name in sorted(list_dir(folder)):
        if name.startswith(_PREFIX) and name.endswith(_SUFFIX):
            key = name[len(_PREFIX):-len(_SUFFIX)]
            keys.append(int(key) if key.isdigit() else key)
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
