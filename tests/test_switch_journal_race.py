"""An abandoned switch's record, seen without the switch lock: a switch starting while it is
looked at is never taken for an abandoned one, whatever its pid says here (a switch run in
another PID namespace has a pid that names no process of this one)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from gpuwatch.hostfs import journal
from gpuwatch.hostfs.bootstate import boot_id
from gpuwatch.hostfs.journal import LOCK_DIR, Journal, find_abandoned, write_journal
from gpuwatch.testing import SysRoot

pytestmark = pytest.mark.timeout(60)

#: A pid no process of this namespace has (above the kernel's PID_MAX_LIMIT).
ELSEWHERE = 4_194_305
GROUP = 1


def _record(pid: int) -> Journal:
    return Journal(addr="0000:01:00.0", group=GROUP, from_mode="host", to_mode="vfio",
                   members=("0000:01:00.0",), pid=pid, started="2024-01-01T00:00:00Z")


def test_a_switch_starting_while_looked_at_is_not_abandoned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lock is free when looked at; then a switch takes it and writes its record before
    the record is read: that switch is running, not abandoned."""
    s = SysRoot(tmp_path / "h")
    s.add_function("0000:01:00.0", driver="nvidia", iommu_group=GROUP)
    root = str(s.root)
    folder = os.path.join(root, LOCK_DIR)
    os.makedirs(folder, exist_ok=True)
    fds: list[int] = []

    def a_switch_starts() -> None:
        """A switch in another PID namespace begins: its lock, then its record."""
        if not fds:
            fd = os.open(os.path.join(folder, f"switch-{GROUP}.lock"),
                         os.O_RDWR | os.O_CREAT, 0o600)
            fds.append(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            write_journal(folder, GROUP, boot_id(root), _record(ELSEWHERE))

    # It begins right after the first look, at the lock or at the record, whichever comes.
    lock_held, read_journal = journal.lock_held, journal.read_journal

    def lock_looked_at(where: str, key: journal.PoisonKey | None) -> bool:
        held = lock_held(where, key)
        a_switch_starts()
        return held

    def record_read(where: str, key: journal.PoisonKey, boot: str) -> Journal | None:
        found = read_journal(where, key, boot)
        a_switch_starts()
        return found

    monkeypatch.setattr(journal, "lock_held", lock_looked_at)
    monkeypatch.setattr(journal, "read_journal", record_read)
    try:
        assert find_abandoned(root, GROUP) is None
        assert find_abandoned(root, GROUP) is None  # and once it is under way
    finally:
        for fd in fds:
            os.close(fd)
    # Its process gone (the lock released by the kill, the record left): abandoned.
    assert find_abandoned(root, GROUP) == _record(ELSEWHERE)


def test_marking_a_record_reported_leaves_a_newer_switch_s_record_alone(tmp_path: Path) -> None:
    """A watcher found an abandoned record and published its end; before it marked that
    record reported, a new switch of the group wrote its own. Marking must not put the old
    record back over the new one (were the new switch killed too, nothing would tell)."""
    s = SysRoot(tmp_path / "h")
    s.add_function("0000:01:00.0", driver="nvidia", iommu_group=GROUP)
    root = str(s.root)
    folder = os.path.join(root, LOCK_DIR)
    os.makedirs(folder, exist_ok=True)
    boot = boot_id(root)
    old, new = _record(ELSEWHERE), _record(os.getpid())
    write_journal(folder, GROUP, boot, new)
    journal.mark_reported(folder, GROUP, boot, old)
    assert journal.read_journal(folder, GROUP, boot) == new
    write_journal(folder, GROUP, boot, old)
    journal.mark_reported(folder, GROUP, boot, old)
    marked = journal.read_journal(folder, GROUP, boot)
    assert marked is not None and marked.reported and marked.pid == ELSEWHERE
