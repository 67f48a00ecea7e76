"""Where a restarted writer numbers from: the seq held in ``PATH.lock`` (bounded, and kept
only when the lock file could take it), and the last seq of a log whose newest file's tail
is junk past the search bound (older files still bound it from below)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gpuwatch.watch import eventlog
from gpuwatch.watch.eventlog import EventLog, lock_path


def line(seq: int) -> str:
    return (f'{{"seq":{seq},"time":"2026-01-01T00:00:00.000000Z","type":"resync",'
            '"reason":"reconcile","changes":0}')


def lines(first: int, last: int) -> bytes:
    return "".join(line(seq) + "\n" for seq in range(first, last + 1)).encode()


def lock_with_record(path: Path, record: bytes) -> None:
    Path(lock_path(path)).write_bytes(b"1\n".ljust(32) + record.ljust(31) + b"\n")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("record", [b"99999999999999999999", b"9223372036854775808",
                                    b"9007199254740992", b"1" + b"0" * 30])
def test_a_held_seq_past_2_53_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, record: bytes
) -> None:
    """A record of up to 20 digits was taken: numbering jumped past int64 and what a double
    holds exactly. Above 2**53 - 1 it is damage: ignored, said once."""
    path = tmp_path / "events.jsonl"
    path.write_bytes(lines(1, 5))
    lock_with_record(path, record)
    with caplog.at_level(logging.WARNING, logger="gpuwatch.watch.eventlog"), \
            EventLog(path) as log:
        assert log.last_seq == 5 and log.unwritten is None
    warned = [r.getMessage() for r in caplog.records if "lock file" in r.getMessage()]
    assert len(warned) == 1 and "2**53 - 1; ignored" in warned[0]


@pytest.mark.timeout(30)
def test_a_held_seq_of_2_53_minus_1_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(lines(1, 5))
    lock_with_record(path, b"9007199254740991")
    with EventLog(path) as log:
        assert log.last_seq == 2**53 - 1 and log.unwritten == (6, 2**53 - 1)


def junk_tail(path: Path, head: bytes, junk: int) -> None:
    """``head`` and then ``junk`` bytes of NULs and a newline: a crash's tail."""
    with path.open("wb") as f:
        f.write(head)
        f.write(b"\0" * junk + b"\n")


@pytest.mark.timeout(60)
def test_a_given_up_tail_numbers_after_the_older_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """PATH's tail is junk past the search bound: the log was taken to hold no event, the
    new run numbered from 1, and a subscriber got the old run's events under the new run's
    seqs. Now the older files (and PATH's head) bound the numbering from below."""
    monkeypatch.setattr(eventlog, "LAST_SEQ_SCAN", 256 << 10)
    path = tmp_path / "events.jsonl"
    Path(f"{path}.1").write_bytes(lines(1, 1000))
    junk_tail(path, b"x" * 70_000 + b"\n" + lines(1001, 1010), 300 << 10)  # head: no event
    with caplog.at_level(logging.WARNING, logger="gpuwatch.watch.eventlog"):
        assert eventlog.last_seq_in(path) == 1000
    assert [r.getMessage() for r in caplog.records] == [
        f"event log {path}: no event in the last 0 MiB of {path}; numbering after seq 1000, "
        "the newest found before it (the log may hold later ones)"]
    junk_tail(path, lines(1001, 1010), 300 << 10)  # its head's events count too
    with EventLog(path) as log:
        assert log.last_seq == 1010


@pytest.mark.timeout(60)
def test_every_file_given_up_numbers_from_1_or_after_the_held_seq(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(eventlog, "LAST_SEQ_SCAN", 256 << 10)
    path = tmp_path / "events.jsonl"
    junk_tail(path, b"", 300 << 10)
    junk_tail(Path(f"{path}.1"), b"", 300 << 10)
    with caplog.at_level(logging.WARNING, logger="gpuwatch.watch.eventlog"):
        assert eventlog.last_seq_in(path) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"event log {path}: no event in the last 0 MiB of {path}, {path}.1; numbering as if "
        "the log held none"]
    lock_with_record(path, b"40")
    with EventLog(path) as log:
        assert log.last_seq == 40 and log.unwritten == (1, 40)
