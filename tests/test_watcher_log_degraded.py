"""What a watcher says about a log it cannot write: the first failed write of each run is
announced (also when an earlier run's unwritten seqs were inherited), and at its stop it
promises a restart numbers after its seqs only when ``PATH.lock`` could keep them."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.sources.memory import MemorySource
from gpuwatch.testing import SysRoot
from gpuwatch.watch import eventlog
from gpuwatch.watch.eventlog import EventLog, EventLogWriteError, lock_path
from gpuwatch.watch.watcher import open_watcher


def line(seq: int) -> str:
    return (f'{{"seq":{seq},"time":"2026-01-01T00:00:00.000000Z","type":"resync",'
            '"reason":"reconcile","changes":0}')


def full_disk_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: EventLog, lines: Any) -> None:
        raise EventLogWriteError(errno.ENOSPC, "ENOSPC: No space left on device")

    monkeypatch.setattr(EventLog, "write_lines", refuse)


async def run_once(host: SysRoot, log: EventLog) -> list[Any]:
    """A run that publishes ``ready`` and stops: what its listeners heard."""
    heard: list[Any] = []
    async with open_watcher(host.root, MemorySource(), log=log, reconcile_interval=0,
                            cdi_poll_interval=0, vgpu_poll_interval=0, announce=False) as w:
        w.listeners.append(heard.append)
        w.announce_ready()
        w.stop("signal SIGTERM")
    return [getattr(event, "type", None) for event in heard]


@pytest.mark.timeout(60)
async def test_a_restart_on_a_still_full_disk_announces_the_degraded_log(
    host: SysRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The run before stopped on a full disk (its seqs held in ``PATH.lock``): this run
    inherits that gap, and its first failed write said nothing (no ``log-degraded``, no
    "events go on" line), as if the log had been failing in this run already."""
    path = tmp_path / "events.jsonl"
    path.write_text("".join(line(seq) + "\n" for seq in range(1, 6)))
    Path(lock_path(path)).write_bytes(b"1\n".ljust(32) + b"40".ljust(31) + b"\n")
    log = EventLog(path)
    assert log.unwritten == (6, 40)
    full_disk_writes(monkeypatch)
    with caplog.at_level(logging.ERROR, logger="gpuwatch.watch"), log:
        types = await run_once(host, log)
    assert types.count("log-degraded") == 1
    going_on = [r.getMessage() for r in caplog.records if "events go on" in r.getMessage()]
    assert len(going_on) == 1


@pytest.mark.timeout(60)
async def test_seqs_a_fresh_lock_file_cannot_keep_are_not_promised(
    host: SysRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``PATH.lock`` first made on a full disk is empty: the seq record cannot be written,
    yet the last line said "a restart numbers after N" and the restart reused them. Now
    it says they are not kept; and once a write succeeds the lock file gets its pid and
    record, so a later hold is kept."""
    path = tmp_path / "events.jsonl"
    path.write_text("".join(line(seq) + "\n" for seq in range(1, 6)))

    def no_room(fd: int, data: Any, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(eventlog.os, "pwrite", no_room)
    log = EventLog(path)
    assert os.path.getsize(lock_path(path)) == 0
    full_disk_writes(monkeypatch)
    with caplog.at_level(logging.ERROR, logger="gpuwatch.watch"), log:
        await run_once(host, log)
    stopped = [r.getMessage() for r in caplog.records if "never written" in r.getMessage()]
    assert len(stopped) == 1 and stopped[0].endswith("(not kept: a restart may reuse 6..8)")
    monkeypatch.undo()
    with EventLog(path) as again:  # room again: nothing held, the lock file is remade
        assert again.last_seq == 5
        again.write_lines([line(6)])
        lock = Path(lock_path(path)).read_bytes()
        assert lock[:32].strip() == str(os.getpid()).encode() and len(lock) == 64
        assert again.hold_seq(9)
    with EventLog(path) as third:
        assert third.unwritten == (7, 9)


@pytest.mark.timeout(60)
async def test_a_write_that_succeeds_pads_a_short_lock_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock file stayed short on the run's full disk start; the first write that gets
    through fills in its pid and record, in the same run, so a hold after it is kept."""
    path = tmp_path / "events.jsonl"
    real_pwrite = os.pwrite
    refused = [True]

    def maybe(fd: int, data: Any, offset: int) -> int:
        if refused[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(eventlog.os, "pwrite", maybe)
    with EventLog(path) as log:
        assert not log.hold_seq(3)
        refused[0] = False
        log.write_lines([line(1)])
        assert os.path.getsize(lock_path(path)) == 64
        assert log.hold_seq(3)
    with EventLog(path) as again:
        assert again.unwritten == (2, 3)
