"""Where a restarted writer numbers from: the seq held in ``PATH.lock`` (bounded, and kept
only when the lock file could take it), and the last seq of a log whose newest file's tail
is junk past the search bound (older files still bound it from below)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

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
