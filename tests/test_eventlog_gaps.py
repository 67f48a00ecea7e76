"""The event log's holes told as holes: a short write's whole lines stay out of the gap, a
writer stopped on a full disk leaves its last seq in ``PATH.lock`` for the next run, a
``log-gap`` record is a hole to a replay, and a replay across a crash's NULs reads at most
4 KiB per chunk."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.watch import eventlog
from gpuwatch.watch.eventlog import EventLog, EventLogWriteError, read_chunks


def line(seq: int, etype: str = "resync", **extra: Any) -> str:
    fields = "".join(f',"{k}":{v}' for k, v in extra.items())
    return (f'{{"seq":{seq},"time":"2026-01-01T00:00:00.000000Z","type":"{etype}"'
            f'{fields}}}')


@pytest.mark.timeout(30)
def test_a_short_write_says_how_many_whole_lines_landed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    lines = [line(1), line(2), line(3)]
    real_write = os.write
    calls = []

    def short_then_full(fd: int, data: Any) -> int:
        calls.append(len(data))
        if len(calls) == 1:  # the first line and a piece of the second, then ENOSPC
            return real_write(fd, bytes(data[: len(lines[0]) + 10]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(eventlog.os, "write", short_then_full)
    with pytest.raises(EventLogWriteError) as caught:
        log.write_lines(lines)
    monkeypatch.undo()
    assert caught.value.lines_written == 1
    log.close()


@pytest.mark.timeout(30)
def test_a_seq_held_in_the_lock_file_is_numbered_after(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    log.write_lines([line(1), line(2)])
    assert log.hold_seq(9)  # published up to 9, written up to 2 (a full disk)
    log.close()
    again = EventLog(path)
    assert again.last_seq == 9
    assert again.unwritten == (3, 9)
    again.write_lines([line(10)])  # written: nothing is held any more
    again.close()
    third = EventLog(path)
    assert third.last_seq == 10 and third.unwritten is None
    third.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("since", [3, 4, 5])
def test_a_log_gap_record_is_a_hole_not_an_event(tmp_path: Path, since: int) -> None:
    path = tmp_path / "events.jsonl"
    gap = line(6, "log-gap", first_seq=4, last_seq=6, error='"ENOSPC"')
    path.write_text("\n".join([line(1), line(2), line(3), gap, line(7), line(8)]) + "\n")
    chunks = list(read_chunks(path, since_seq=since))
    assert chunks[0].gap == 4 and chunks[0].first == chunks[0].last == 6
    assert (chunks[1].first, chunks[1].last, chunks[1].gap) == (7, 8, 0)


@pytest.mark.timeout(30)
def test_a_log_gap_of_one_seq_ends_a_run_of_plain_lines(tmp_path: Path) -> None:
    """Seqs 5, log-gap 6, 7 run on: only its type tells the record from event 6."""
    path = tmp_path / "events.jsonl"
    gap = line(6, "log-gap", first_seq=6, last_seq=6, error='"EIO"')
    path.write_text("\n".join([line(4), line(5), gap, line(7)]) + "\n")
    chunks = [(c.first, c.last, c.gap) for c in read_chunks(path, since_seq=3)]
    assert chunks == [(4, 5, 0), (6, 6, 6), (7, 7, 0)]


@pytest.mark.timeout(60)
def test_a_replay_across_nuls_reads_at_most_4_kib_per_chunk(tmp_path: Path) -> None:
    """A crash's NULs (no newline in 1 MiB): a chunk for every read, so a caller on an
    event loop ends its turn between any two, instead of one `next` reading it all."""
    path = tmp_path / "events.jsonl"
    with path.open("wb") as f:
        f.write((line(1) + "\n" + line(2) + "\n").encode())
        f.write(b"\0" * (1 << 20) + b"\n")
        f.write((line(3) + "\n").encode())
    chunks = list(read_chunks(path, since_seq=0, progress=True))
    assert [(c.first, c.last) for c in chunks if c.first] == [(1, 2), (3, 3)]
    assert len(chunks) >= (1 << 20) // (4 << 10)
    assert [c for c in read_chunks(path, since_seq=0) if not c.first] == []


@pytest.mark.timeout(60)
def test_a_replay_across_a_long_line_copies_it_once(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading across 2 MiB of NULs feeds the line framer each read once: taking the
    unfinished line back out of the framer at every read fed it all again each time
    (quadratic: hundreds of MiB copied for a 2 MiB stretch, seconds of the event loop)."""
    from gpuwatch.core.ndjson import LineFramer

    fed = 0
    real_feed = LineFramer.feed

    def counted(self: LineFramer, data: bytes) -> list[bytes]:
        nonlocal fed
        fed += len(data)
        return real_feed(self, data)

    monkeypatch.setattr(LineFramer, "feed", counted)
    path = tmp_path / "events.jsonl"
    region = 2 << 20
    with path.open("wb") as f:
        f.write((line(1) + "\n" + line(2) + "\n").encode())
        f.write(b"\0" * region + b"\n")
        f.write((line(3) + "\n").encode())
    chunks = list(read_chunks(path, since_seq=0, progress=True))
    assert [(c.first, c.last) for c in chunks if c.first] == [(1, 2), (3, 3)]
    assert fed <= 2 * region, fed


@pytest.mark.timeout(30)
def test_a_log_gap_record_spaced_by_hand_is_a_hole_too(tmp_path: Path) -> None:
    """A hand-edited (or another tool's) log-gap line, spaced as JSON allows: decoded, not
    vouched for as an event by its seq."""
    path = tmp_path / "events.jsonl"
    gap = ('{"seq": 6, "time": "2026-01-01T00:00:00.000000Z", "type": "log-gap", '
           '"first_seq": 4, "last_seq": 6, "error": "ENOSPC"}')
    path.write_text("\n".join([line(1), line(2), line(3), gap, line(7)]) + "\n")
    chunks = list(read_chunks(path, since_seq=5))
    assert (chunks[0].first, chunks[0].last, chunks[0].gap) == (6, 6, 4)
    assert (chunks[1].first, chunks[1].last, chunks[1].gap) == (7, 7, 0)
