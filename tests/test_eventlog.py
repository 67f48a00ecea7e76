"""The JSONL event log: rotation that never splits or loses a line, readers that never show a
torn line, follow across rotation, and the ``gpuwatch events`` command."""

from __future__ import annotations

import argparse
import errno
import io
import itertools
import json
import logging
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from watch_helpers import count_log_reads

from gpuwatch.cli import events_cmd
from gpuwatch.core.events import format_event_time
from gpuwatch.watch import eventlog
from gpuwatch.watch.eventlog import (
    EventLog,
    EventLogClosedError,
    EventLogWriteError,
    afollow_events,
    follow_events,
    last_seq_in,
    read_events,
    read_records,
)

REPO = Path(__file__).resolve().parents[1]


TIME = "2026-12-02T17:20:41.123456Z"


def line(seq: int, type_: str = "ready", **extra: Any) -> str:
    """A stored event line; fixed time so lines can be compared byte for byte."""
    event = {"seq": seq, "time": TIME, "type": type_, **extra}
    return json.dumps(event, separators=(",", ":"))


def write_events(log: EventLog, first: int, last: int, type_: str = "ready") -> None:
    for seq in range(first, last + 1):
        log.write_line(line(seq, type_))


def seqs(events: Iterator[dict[str, Any]] | list[dict[str, Any]]) -> list[int]:
    return [e["seq"] for e in events]


def log_files(path: Path) -> list[Path]:
    """PATH.N … PATH.1, PATH: oldest first, the order readers use."""
    rotated = sorted((p for p in path.parent.glob(path.name + ".*") if p.suffix[1:].isdigit()),
                     key=lambda p: -int(p.suffix[1:]))
    return [*rotated, path]


class Collector:
    """Runs follow_events in a thread so the test can write meanwhile."""

    def __init__(self, path: Path, **kwargs: Any) -> None:
        self.events: list[dict[str, Any]] = []
        self.stopping = threading.Event()
        self._error: BaseException | None = None
        kwargs.setdefault("poll_interval", 0.005)

        def target() -> None:
            try:
                for event in follow_events(path, stop=self.stopping.is_set, **kwargs):
                    self.events.append(event)
            except BaseException as exc:  # surfaced in stop()
                self._error = exc

        self._thread = threading.Thread(target=target, daemon=True)
        self._thread.start()

    def wait_for(self, pred: Callable[[list[dict[str, Any]]], bool], timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not pred(self.events):
            assert time.monotonic() < deadline, f"timed out; have {seqs(self.events)[-5:]}"
            time.sleep(0.005)

    def stop(self) -> list[dict[str, Any]]:
        self.stopping.set()
        self._thread.join(5)
        assert not self._thread.is_alive(), "follow_events ignored stop()"
        if self._error is not None:
            raise self._error
        return self.events


# ------------------------------------------------------------------ writer and rotation


def test_rotation_under_burst_keeps_whole_lines_and_newest_events(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    (tmp_path / "events.jsonl.4").write_text("stale from a run with a larger keep\n")
    with EventLog(path, max_bytes=1500, keep=3) as log:
        write_events(log, 1, 10_000)

    assert sorted(p.name for p in tmp_path.iterdir()) == [  # and the writer's lock file
        "events.jsonl", "events.jsonl.1", "events.jsonl.2", "events.jsonl.3", "events.jsonl.lock"]
    on_disk: list[int] = []
    for f in log_files(path):
        data = f.read_bytes()
        assert data.endswith(b"\n"), f
        assert len(data) <= 1500, f
        on_disk += [json.loads(raw)["seq"] for raw in data.splitlines()]  # every line whole
    assert on_disk == list(range(on_disk[0], 10_001))
    assert len(on_disk) > 3 * 15  # the rotated files are full, not near-empty
    assert seqs(read_events(path)) == on_disk


def test_line_larger_than_max_bytes_gets_a_file_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    big = line(2, "ready", pad="x" * 300)
    with EventLog(path, max_bytes=100, keep=5) as log:
        log.write_line(line(1))
        log.write_line(big)
        log.write_line(line(3))
    assert (tmp_path / "ev.jsonl.2").read_text() == line(1) + "\n"
    assert (tmp_path / "ev.jsonl.1").read_text() == big + "\n"
    assert path.read_text() == line(3) + "\n"


def test_no_rotation_without_max_bytes_and_keep_zero_discards(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    with EventLog(path) as log:
        write_events(log, 1, 500)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ev.jsonl", "ev.jsonl.lock"]
    with EventLog(tmp_path / "z.jsonl", max_bytes=200, keep=0) as log:
        write_events(log, 1, 50)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ev.jsonl", "ev.jsonl.lock", "z.jsonl", "z.jsonl.lock"]
    assert seqs(read_events(tmp_path / "z.jsonl"))[-1] == 50


def test_last_seq_continues_numbering_after_reopen(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "ev.jsonl"  # parent created on demand
    with EventLog(path, max_bytes=400, keep=2) as log:
        assert log.last_seq is None
        write_events(log, 1, 30)
    with EventLog(path, max_bytes=400, keep=2) as log:
        assert log.last_seq == 30
        assert log.last_seq is not None
        write_events(log, log.last_seq + 1, 40)
    assert last_seq_in(path) == 40
    assert seqs(read_events(path))[-1] == 40

    # PATH empty (a crash right after rotation): the newest rotated file answers.
    newest_rotated = json.loads((path.parent / "ev.jsonl.1").read_text().splitlines()[-1])
    path.write_bytes(b"")
    assert EventLog(path).last_seq == newest_rotated["seq"]
    path.unlink()
    assert last_seq_in(path) == newest_rotated["seq"]
    assert last_seq_in(tmp_path / "nothing.jsonl") is None


def test_last_seq_ignores_torn_tail_and_writer_seals_it(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    path.write_text(line(1) + "\n" + line(2) + "\n" + line(3)[:20])
    assert last_seq_in(path) == 2
    with EventLog(path) as log:
        assert log.last_seq == 2
        log.write_line(line(3))
    # The torn fragment became its own (malformed) line instead of gluing onto event 3.
    assert path.read_text().splitlines()[2] == line(3)[:20]
    assert seqs(read_events(path)) == [1, 2, 3]


def test_last_seq_scans_back_across_large_files(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    with EventLog(path) as log:
        log.write_line(line(1, "ready", pad="y" * 200_000))  # longer than one read block
        log.write_line(line(2, "ready", pad="z" * 70_000))
    with path.open("a") as f:
        f.write("not json\n")
    assert last_seq_in(path) == 2


def test_a_crash_tail_of_nuls_is_passed_over_holding_one_line_at_most(tmp_path: Path) -> None:
    """A crash can leave the end of an appended file as megabytes of NULs with no newline.
    Finding the last seq (every watcher start) and replaying from a seq must pass over it
    without gathering it: the search used to hold the whole tail, copying it once per read
    (minutes for 64 MiB, memory for all of it)."""
    path = tmp_path / "ev.jsonl"
    path.write_text(line(1) + "\n" + line(2) + "\n")
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size + 12 * (1 << 20))  # a hole reads as NULs
    tracemalloc.start()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(eventlog, "MAX_EVENT_LINE", 1 << 20)
            assert last_seq_in(path) == 2
            with path.open("ab") as f:
                f.write(("\n" + "\n".join(line(s) for s in range(3, 2000)) + "\n").encode())
            assert last_seq_in(path) == 1999
            assert seqs(read_events(path, since_seq=1)) == list(range(2, 2000))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20  # one capped line and a read or two, never the 12 MiB


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=30).map(lambda b: b.replace(b"\n", b"")),
                          st.just(b"")), max_size=12),
       st.binary(max_size=12).map(lambda b: b.replace(b"\n", b"")), st.integers(1, 9))
def test_reverse_lines_are_the_complete_lines_backwards(
    lines: list[bytes], tail: bytes, chunk: int
) -> None:
    """Against the plain definition, with reads smaller than lines: every complete line of
    at most MAX_EVENT_LINE bytes, last first; the torn tail and longer lines are left out."""
    data = b"".join(item + b"\n" for item in lines) + tail
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(eventlog, "_CHUNK", chunk)
        patch.setattr(eventlog, "MAX_EVENT_LINE", 20)
        got = list(eventlog._reverse_lines(io.BytesIO(data)))
    assert got == [item for item in reversed(lines) if len(item) <= 20]


def test_a_rotation_that_fails_is_retried_after_another_max_bytes_not_every_write(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """PATH.1 that cannot be replaced (here a directory with a file in it): no event is lost,
    and the rotation is not tried again (a reopen and a warning) before every write."""
    path = tmp_path / "ev.jsonl"
    (tmp_path / "ev.jsonl.1").mkdir()
    (tmp_path / "ev.jsonl.1" / "keep").write_text("")
    per_line = len(line(1)) + 1
    with caplog.at_level(logging.WARNING, logger="gpuwatch.watch.eventlog"):
        log = EventLog(path, max_bytes=10 * per_line, keep=1)
        write_events(log, 1, 100)
        log.close()
    stored = [json.loads(text) for text in path.read_text().splitlines()]
    assert seqs(stored) == list(range(1, 101))
    tries = [r for r in caplog.records if "rotation" in r.getMessage()]
    assert 1 <= len(tries) <= 12  # one per max_bytes written (about 10 lines), not 90


def test_a_line_with_a_seq_below_1_is_no_event_and_numbering_never_goes_there(
    tmp_path: Path,
) -> None:
    """Seqs start at 1. A damaged or hand-edited last line with ``"seq": -3`` made the next
    writer number its events -2, -1, 0, … (and ``--since-seq`` meaningless)."""
    path = tmp_path / "ev.jsonl"
    path.write_text(line(4) + "\n" + line(-3) + "\n" + line(0) + "\n")
    with EventLog(path) as log:
        assert log.last_seq == 4
    assert seqs(read_events(path)) == [4]


def test_writer_rejects_newlines_and_use_after_close(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "ev.jsonl")
    with pytest.raises(ValueError, match="line break"):
        log.write_line('{"seq":1,\n"type":"ready"}')
    log.close()
    with pytest.raises(EventLogClosedError):
        log.write_line(line(1))
    with pytest.raises(ValueError):
        EventLog(tmp_path / "x", max_bytes=0)


def test_dash_writes_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    log = EventLog("-", max_bytes=10)
    assert log.last_seq is None
    log.write_line(line(1))
    log.write_line(line(2))
    log.close()
    assert capsys.readouterr().out == line(1) + "\n" + line(2) + "\n"


# ------------------------------------------------------------------ no regular file at PATH


def test_a_device_at_the_log_path_is_written_and_never_rotated_away(tmp_path: Path) -> None:
    """Rotation renames PATH: done to /dev/null (here through a link to it) it would
    replace the device with a plain file, and a later rotation would delete it."""
    path = tmp_path / "ev.jsonl"
    path.symlink_to(os.devnull)
    log = EventLog(path, max_bytes=len(line(1)) + 1, keep=1)  # one event per file
    assert log.last_seq is None
    write_events(log, 1, 5)
    log.close()
    assert path.is_symlink() and os.readlink(path) == os.devnull
    assert not (tmp_path / "ev.jsonl.1").exists()


def drain(fd: int) -> bytes:
    """What a non-blocking pipe holds now."""
    data = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return data
        if not chunk:
            return data
        data += chunk


def test_a_fifo_log_whose_reader_stalls_degrades_instead_of_blocking(tmp_path: Path) -> None:
    """A watcher logging into a FIFO must not freeze when its reader stops reading: the
    write fails (the watcher then degrades the log and retries), and once the reader
    drains, the next write ends the half-written line before its own."""
    fifo = tmp_path / "ev.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        log = EventLog(fifo)
        assert log.last_seq is None
        padded = [line(seq, pad="x" * 5000) for seq in range(1, 1000)]  # past any pipe, and
        # each line past PIPE_BUF, so the write that fills the pipe leaves half a line
        with pytest.raises(EventLogWriteError) as failure:
            for text in padded:
                log.write_line(text)
        assert failure.value.errno == errno.EAGAIN
        received = drain(reader)
        log.write_line(line(5000))
        received += drain(reader)
        log.close()
    finally:
        os.close(reader)
    stored = received.decode().split("\n")[:-1]
    events = [json.loads(text) for text in stored if text in padded or text == line(5000)]
    assert events[-1]["seq"] == 5000
    assert seqs(events) == sorted(seqs(events))
    torn = [text for text in stored if text not in padded and text != line(5000)]
    assert len(torn) <= 1 and all(any(p.startswith(t) for p in padded) for t in torn)


def test_a_terminal_or_fifo_log_takes_no_lock_file_beside_it(tmp_path: Path) -> None:
    """A stream is never rotated or read back, so it needs no ``PATH.lock``: none can be made
    in /dev/pts (a terminal as the log was refused), and a root daemon logging to /dev/null
    would leave /dev/null.lock in /dev."""
    leader, follower = os.openpty()
    os.set_blocking(leader, False)
    try:
        tty = os.ttyname(follower)
        log = EventLog(tty)  # was EventLogUnavailable: cannot open its lock (EACCES)
        log.write_line(line(1))
        log.close()
        assert drain(leader).replace(b"\r\n", b"\n") == (line(1) + "\n").encode()
        assert not os.path.lexists(f"{tty}.lock")
    finally:
        os.close(leader)
        os.close(follower)
    fifo = tmp_path / "ev.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        EventLog(fifo).close()
    finally:
        os.close(reader)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ev.fifo"]


def test_readers_never_open_a_fifo_where_a_log_file_should_be(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Opening a FIFO to read blocks until a writer comes, and reading one takes the bytes
    meant for its own reader: the writer's look for the last seq passes over it, readers
    skip it (with one warning naming it) and read the log's other files, and the writer
    never rotates over it."""
    path = tmp_path / "ev.jsonl"
    os.mkfifo(f"{path}.1")  # nobody writes it: an open for reading would wait forever
    log = EventLog(path, max_bytes=3 * (len(line(1)) + 1))
    assert log.last_seq is None and log.replayable
    with caplog.at_level(logging.WARNING, logger="gpuwatch.watch.eventlog"):
        write_events(log, 1, 10)  # past max_bytes: a rotation would replace the FIFO
        assert seqs(read_events(path)) == list(range(1, 11))
    assert Path(f"{path}.1").is_fifo()
    skipped = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and f"{path}.1" in skipped[0].getMessage()
    log.close()

    fifo = tmp_path / "live.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        log = EventLog(fifo)
        assert not log.replayable
        log.write_line(line(1))
        with pytest.raises(OSError, match="not a regular file"):
            list(read_events(fifo))
        assert os.read(reader, 4096) == line(1).encode() + b"\n"  # nothing was taken
        log.close()
    finally:
        os.close(reader)


async def test_a_subscriber_asking_for_history_of_a_fifo_log_gets_live_events(
    tmp_path: Path,
) -> None:
    """A FIFO log cannot be read back: a replay is incomplete, not an error or a hang."""
    import anyio

    from gpuwatch.sources.memory import MemorySource
    from gpuwatch.watch.watcher import open_watcher

    fifo = tmp_path / "ev.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with anyio.fail_after(30):
            async with (open_watcher(tmp_path, source=MemorySource(), log=fifo,
                                     reconcile_interval=0) as w,
                        w.subscribe(since_seq=0) as sub):
                assert sub.complete is False
        assert json.loads(drain(reader).split(b"\n")[0])["type"] == "ready"
    finally:
        os.close(reader)


def test_format_event_time_is_rfc3339_utc_micro() -> None:
    from datetime import datetime, timedelta, timezone

    when = datetime(2026, 12, 2, 19, 20, 41, 123456, tzinfo=timezone(timedelta(hours=2)))
    assert format_event_time(when) == "2026-12-02T17:20:41.123456Z"


# ------------------------------------------------------------------ one-shot reader


def test_torn_last_line_is_skipped_until_completed(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    third = line(3)
    path.write_text(line(1) + "\n" + line(2) + "\n" + third[:15])
    assert seqs(read_events(path)) == [1, 2]
    with path.open("a") as f:
        f.write(third[15:] + "\n")
    assert seqs(read_events(path)) == [1, 2, 3]


def test_malformed_lines_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    path.write_bytes(b"\n".join([
        line(1).encode(), b"garbage", b"[1,2]", b'{"seq":true,"type":"ready"}',
        b'{"seq":2}', b"\xff\xfe", b"", line(2).encode(), b"",
    ]))
    assert seqs(read_events(path)) == [1, 2]


def test_a_line_nested_deeper_than_the_parser_recurses_is_skipped(tmp_path: Path) -> None:
    # json.loads raises RecursionError, not ValueError, for such a line.
    path = tmp_path / "ev.jsonl"
    deep = '{"seq":5,"type":"ready","x":' + "[" * 100_000 + "]" * 100_000 + "}"
    path.write_text(line(1) + "\n" + deep + "\n" + line(2) + "\n")
    assert seqs(read_events(path)) == [1, 2]


def test_follower_skips_an_over_long_line_without_holding_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line over the follower's cap is no event of ours: skipped, and the events on
    either side of it still arrive (also when it is still being written)."""
    monkeypatch.setattr(eventlog, "MAX_EVENT_LINE", 1000)
    path = tmp_path / "ev.jsonl"
    path.write_text(line(1) + "\n" + line(2, pad="p" * 5000) + "\n" + line(3) + "\n")
    assert seqs(read_events(path)) == [1, 3]
    with path.open("a") as f:
        f.write(line(4, pad="q" * 300_000)[:200_000])  # torn, and already too long
    stop = iter([False, False, False, True]).__next__
    got = list(follow_events(path, poll_interval=0.01, stop=stop))
    with path.open("a") as f:
        f.write("q" * 100 + "\n" + line(5) + "\n")
    assert seqs(got) == [1, 3]
    assert seqs(read_events(path)) == [1, 3, 5]


@pytest.mark.parametrize("since", [0, 1, 4_999, 5_000, 5_001, 19_990, 29_999, 30_000, 31_000])
def test_replay_since_seq_bisects_instead_of_reading_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, since: int
) -> None:
    """A replay from deep inside a rotated log reads a few windows, not every byte before it,
    and still returns exactly the events after ``since`` — damaged lines included."""
    path = tmp_path / "ev.jsonl"
    pad = "x" * 400  # ~13 MiB in all, in files of ~3 MiB
    with EventLog(path, max_bytes=3_000_000, keep=20) as log:
        for seq in range(1, 30_001):
            log.write_line(line(seq, pad=pad))
            if seq % 4_000 == 0:
                log.write_line("not json")  # damage the bisection must step over
    assert len(log_files(path)) > 3
    opened = count_log_reads(monkeypatch)
    got = seqs(read_events(path, since_seq=since))
    read_bytes = sum(f.read_bytes for f in opened)
    assert got == list(range(since + 1, 30_001))
    total = sum(f.stat().st_size for f in log_files(path))
    wanted = sum(len(line(seq, pad=pad)) + 1 for seq in range(since + 1, 30_001))
    skipped = total - wanted
    # What precedes the start costs a few 64 KiB windows per file, never its bytes.
    overhead = read_bytes - wanted
    assert overhead <= 2 * 1024 * 1024
    if skipped > 8 * 1024 * 1024:
        assert overhead < skipped // 4


def test_filters_and_raw_lines(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    with EventLog(path, max_bytes=300, keep=10) as log:
        for seq in range(1, 21):
            log.write_line(line(seq, "resync" if seq % 3 == 0 else "ready"))
    assert seqs(read_events(path, since_seq=15)) == [16, 17, 18, 19, 20]
    assert seqs(read_events(path, types={"resync"})) == [3, 6, 9, 12, 15, 18]
    assert seqs(read_events(path, since_seq=10, types=["resync"])) == [12, 15, 18]
    assert list(read_events(path, types=())) == []
    assert list(read_events(tmp_path / "missing.jsonl")) == []
    stored = [ln for f in log_files(path) for ln in f.read_text().splitlines()]
    assert [r.line for r in read_records(path)] == stored


# ------------------------------------------------------------------ follower


def test_follow_yields_a_torn_line_once_when_its_newline_arrives(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    path.write_text(line(1) + "\n")
    third = line(2)
    col = Collector(path)
    col.wait_for(lambda ev: len(ev) == 1)
    with path.open("a") as f:
        f.write(third[:10])
        f.flush()
        time.sleep(0.1)  # many polls see the fragment
        assert seqs(col.events) == [1]
        f.write(third[10:])
        f.flush()
        time.sleep(0.1)
        assert seqs(col.events) == [1]  # complete JSON but no newline yet: still torn
        f.write("\n")
    col.wait_for(lambda ev: len(ev) == 2)
    time.sleep(0.05)
    assert seqs(col.stop()) == [1, 2]


def test_follow_across_rotations_is_exact(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    col = Collector(path)  # starts before the log exists: waits for it
    time.sleep(0.02)

    def writer() -> None:
        # ~10 events per file: rotations land between polls, several at a time.
        with EventLog(path, max_bytes=600, keep=1000) as log:
            for seq in range(1, 2001):
                log.write_line(line(seq))
                if seq % 97 == 0:
                    time.sleep(0.001)

    t = threading.Thread(target=writer)
    t.start()
    t.join(10)
    col.wait_for(lambda ev: len(ev) >= 2000)
    time.sleep(0.05)
    assert seqs(col.stop()) == list(range(1, 2001))
    assert len(list(tmp_path.iterdir())) > 150


def test_follow_starting_mid_log_with_filters(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    log = EventLog(path, max_bytes=500, keep=50)
    for seq in range(1, 11):
        log.write_line(line(seq, "resync" if seq % 2 else "ready"))
    col = Collector(path, since_seq=4, types={"resync"})
    col.wait_for(lambda ev: len(ev) == 3)
    for seq in range(11, 41):
        log.write_line(line(seq, "resync" if seq % 2 else "ready"))
    log.close()
    col.wait_for(lambda ev: ev[-1]["seq"] == 39)
    assert seqs(col.stop()) == list(range(5, 40, 2))


def test_follow_does_not_repeat_a_seq(tmp_path: Path) -> None:
    # A log that repeats itself (a copy appended, or a scan racing rotation) prints once.
    path = tmp_path / "ev.jsonl"
    path.write_text("".join(line(s) + "\n" for s in (1, 2, 3, 2, 3, 4)))
    assert seqs(read_events(path)) == [1, 2, 3, 4]


def test_follow_drains_a_file_rotated_between_its_last_read_and_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ev.jsonl"
    log = EventLog(path, max_bytes=4 * (len(line(1)) + 1), keep=5)  # 4 lines per file
    write_events(log, 1, 3)
    deadline = time.monotonic() + 5
    gen = follow_events(path, poll_interval=0.01, stop=lambda: time.monotonic() > deadline)
    assert [next(gen)["seq"] for _ in range(3)] == [1, 2, 3]

    real_stat_ident = eventlog._stat_ident
    armed = True

    def racing_stat_ident(name: str) -> tuple[int, int] | None:
        nonlocal armed
        if armed and name == str(path):
            armed = False  # the follower just hit EOF; now the writer appends and rotates
            write_events(log, 4, 5)
        return real_stat_ident(name)

    monkeypatch.setattr(eventlog, "_stat_ident", racing_stat_ident)
    assert [next(gen)["seq"] for _ in range(2)] == [4, 5]
    assert not armed and (tmp_path / "ev.jsonl.1").exists()
    cast(Generator[dict[str, Any], None, None], gen).close()
    log.close()


def test_read_rescans_when_rotations_complete_during_the_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ev.jsonl"
    log = EventLog(path, max_bytes=len(line(1)) + 1, keep=50)  # one event per file
    write_events(log, 1, 3)
    real_open = eventlog._open_log_file
    fired = False

    def racing_open(name: str) -> Any:
        nonlocal fired
        if not fired and name == f"{path}.1":
            fired = True  # PATH is already open; two rotations now shift every name
            write_events(log, 4, 5)
        return real_open(name)

    monkeypatch.setattr(eventlog, "_open_log_file", racing_open)
    assert seqs(read_events(path)) == [1, 2, 3, 4, 5]
    assert fired
    log.close()


async def test_afollow_events(tmp_path: Path) -> None:
    import anyio

    path = tmp_path / "ev.jsonl"
    log = EventLog(path, max_bytes=250, keep=100)
    write_events(log, 1, 5)
    got: list[int] = []

    async def feed() -> None:
        for seq in range(6, 31):
            log.write_line(line(seq))
            if seq % 5 == 0:
                await anyio.sleep(0.01)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(feed)
            async for event in afollow_events(path, poll_interval=0.005,
                                              stop=lambda: len(got) >= 30):
                got.append(event["seq"])
    log.close()
    assert got == list(range(1, 31))


# ------------------------------------------------------------------ gpuwatch events


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpuwatch")
    events_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["events", *argv])
    code: int = args.func(args)
    return code


def test_cli_prints_stored_lines_and_filters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ev.jsonl"
    stored = [json.dumps({"seq": s, "time": format_event_time(),
                          "type": "resync" if s in (2, 4) else "ready"}) for s in range(1, 6)]
    path.write_text("\n".join(stored) + "\n" + stored[0][:5])  # with spaces: printed as is
    assert run_cli([str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == stored
    assert run_cli([str(path), "--since-seq", "3"]) == 0
    assert capsys.readouterr().out.splitlines() == stored[3:]
    assert run_cli([str(path), "--type", "resync,ready", "--type", "ready"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 5
    assert run_cli([str(path), "--type", "resync"]) == 0
    assert capsys.readouterr().out.splitlines() == [stored[1], stored[3]]


def test_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.jsonl"
    assert run_cli([str(missing)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(missing) in err

    assert run_cli([str(tmp_path)]) == 1  # a directory
    assert capsys.readouterr().err.count("\n") == 1

    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "nowhere.jsonl")  # a link to a log not there
    assert run_cli([str(dangling)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"no event log at {dangling}" in err

    (tmp_path / "ev.jsonl").write_text(line(1) + "\n")
    for bad in (["--type", "no-such-type"], ["--type", ","]):
        assert run_cli([str(tmp_path / "ev.jsonl"), *bad]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1

    # Parse-level errors go through the dispatcher's one-line parser: exit 2.
    with pytest.raises(SystemExit) as exc:
        events_cmd.main([str(tmp_path / "ev.jsonl"), "--since-seq", "x"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("follow", [False, True])
def test_cli_refuses_an_empty_path_as_a_usage_error(
    capsys: pytest.CaptureFixture[str], follow: bool
) -> None:
    """No file is ever named ``""``: ``--follow`` waited for it for ever (``watch --log ''``
    is refused the same way)."""
    assert run_cli(["", *(["--follow"] if follow else [])]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "must not be empty" in captured.err


@pytest.mark.parametrize("follow", [False, True])
def test_cli_refuses_a_fifo_at_the_path_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], follow: bool
) -> None:
    fifo = tmp_path / "ev.jsonl"
    os.mkfifo(fifo)  # no writer: reading it would wait forever
    assert run_cli([str(fifo), *(["--follow"] if follow else [])]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "FIFO" in err and str(fifo) in err


def test_cli_says_when_stdout_fails_not_that_the_log_does(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    path.write_text(line(1) + "\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "gpuwatch", "events", str(path)]
    with open("/dev/full", "w") as full:
        proc = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True,
                              env=env, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "cannot write to stdout" in proc.stderr
    closed = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env, timeout=60,
                            preexec_fn=lambda: os.close(1))
    assert closed.returncode == 2
    assert closed.stderr.count("\n") == 1 and "stdout is closed" in closed.stderr


class LineReader:
    """Lines of a child's stdout with a timeout, so a broken follower fails instead of hanging."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self._lines: queue.Queue[str] = queue.Queue()
        assert proc.stdout is not None
        self._stdout = proc.stdout

        def pump() -> None:
            for text in self._stdout:
                self._lines.put(text)

        self._thread = threading.Thread(target=pump, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """After the child exited: its stdout is at EOF, so the pump ends."""
        self._thread.join(5)
        self._stdout.close()

    def seqs(self, n: int) -> list[int]:
        return [json.loads(self._lines.get(timeout=5))["seq"] for _ in range(n)]

    def raw(self, n: int) -> list[str]:
        return [self._lines.get(timeout=10) for _ in range(n)]

    def raw_left(self) -> list[str]:
        left = []
        while not self._lines.empty():
            left.append(self._lines.get_nowait())
        return left


def _spawn_follow(path: Path, *extra: str) -> subprocess.Popen[str]:
    code = ("import sys; from gpuwatch.cli.events_cmd import main; "
            f"sys.exit(main([{str(path)!r}, '--follow', *{list(extra)!r}]))")
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_follow_waits_for_log_and_exits_zero_on_signal(tmp_path: Path, sig: int) -> None:
    path = tmp_path / "ev.jsonl"
    proc = _spawn_follow(path)  # the log does not exist yet
    lines = LineReader(proc)
    try:
        time.sleep(0.2)
        assert proc.poll() is None, "must wait for a missing log under --follow"
        with EventLog(path, max_bytes=200, keep=10) as log:
            write_events(log, 1, 3)
            assert lines.seqs(3) == [1, 2, 3]
            write_events(log, 4, 9)  # crosses a rotation
            assert lines.seqs(6) == list(range(4, 10))
        start = time.monotonic()
        proc.send_signal(sig)
        proc.wait(timeout=2)
        assert time.monotonic() - start < 2
        assert proc.stderr is not None
        err = proc.stderr.read()
        assert proc.returncode == 0, err
        assert err == ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        lines.close()
        assert proc.stderr is not None
        proc.stderr.close()


def test_cli_follow_ends_when_its_reader_leaves_though_no_event_comes(
        tmp_path: Path) -> None:
    """``gpuwatch events --follow LOG | head -1`` on a quiet log: the reader has gone, and
    no write will ever fail to say so. The follower sees it (exit 0, nothing on stderr), as
    ``tail -f`` does; was: it followed on, for ever."""
    path = tmp_path / "ev.jsonl"
    with EventLog(path) as log:
        write_events(log, 1, 3)
    proc = subprocess.Popen([sys.executable, "-m", "gpuwatch", "events", str(path), "--follow"],
                            cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert json.loads(proc.stdout.readline())["seq"] == 1
        proc.stdout.close()  # as head does once it has its line
        proc.wait(timeout=30)
        assert (proc.returncode, proc.stderr.read()) == (0, "")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signals", [(signal.SIGTERM,), (signal.SIGINT,),
                                     (signal.SIGTERM, signal.SIGTERM)])
def test_cli_follow_into_a_reader_that_stopped_reading_ends_on_a_signal(
        tmp_path: Path, signals: tuple[signal.Signals, ...]) -> None:
    """``gpuwatch events --follow LOG | stuck-consumer``: the pipe is full and the
    follower waits on it. SIGTERM or SIGINT ends it, exit 0, within the 2 s the last lines
    are given (a second signal ends that wait at once); was: it sat in ``write()`` for ever,
    each signal only interrupting the write to restart it. What reached the pipe is whole
    lines."""
    path = tmp_path / "ev.jsonl"
    with EventLog(path) as log:  # ~2 MiB: more than the pipe and the writer's buffer hold
        for first in range(1, 20001, 1000):
            log.write_lines([line(seq, "x") for seq in range(first, first + 1000)])
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuwatch", "events", str(path), "--follow"], cwd=REPO,
            stdout=write_end, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
        os.close(write_end)
        write_end = -1
        try:
            deadline = time.monotonic() + 30
            while len(select.select([read_end], [], [], 0)[0]) == 0:  # it has begun writing
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.02)
            time.sleep(0.5)  # ... and has filled the pipe by now: nobody reads it
            started = time.monotonic()
            for signum in signals:
                proc.send_signal(signum)
                time.sleep(0.2)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                raise AssertionError("the follower outlived SIGTERM/SIGINT") from None
            took = time.monotonic() - started
            assert proc.stderr is not None
            assert (proc.returncode, proc.stderr.read()) == (0, b"")
            assert took < (1.5 if len(signals) > 1 else 5)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            assert proc.stderr is not None
            proc.stderr.close()
        out = b""
        while chunk := os.read(read_end, 1 << 20):  # the follower has gone: EOF at the end
            out += chunk
        assert out.endswith(b"\n")
        got = [json.loads(text)["seq"] for text in out.decode().splitlines()]
        assert got == list(range(1, len(got) + 1)) and len(got) < 20000
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)


def test_cli_follow_into_a_file_keeps_following(tmp_path: Path) -> None:
    """A file (or a terminal) never reads as a reader that left."""
    path = tmp_path / "ev.jsonl"
    out = tmp_path / "out.jsonl"
    with EventLog(path) as log:
        write_events(log, 1, 2)
        code = ("import sys; from gpuwatch.cli.events_cmd import main; "
                f"sys.exit(main([{str(path)!r}, '--follow']))")
        with open(out, "w") as sink:
            proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=sink,
                                    stderr=subprocess.PIPE,
                                    env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            deadline = time.monotonic() + 30
            while out.read_text().count("\n") < 2:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.02)
            write_events(log, 3, 3)
            while out.read_text().count("\n") < 3:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.02)
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert [json.loads(x)["seq"] for x in out.read_text().splitlines()] == [1, 2, 3]


def test_write_lines_rotates_between_lines_of_one_batch(tmp_path: Path) -> None:
    path = tmp_path / "batch.jsonl"
    event = {"time": "t", "type": "ready", "pad": "x" * 40}
    lines = [json.dumps({"seq": i, **event}) for i in range(1, 31)]
    with EventLog(path, max_bytes=400, keep=20) as log:
        log.write_lines(lines[:10])
        log.write_lines(lines[10:])
    files = sorted(tmp_path.glob("batch.jsonl*"))
    assert len(files) > 3  # the batches were split across rotations
    for f in files:
        data = f.read_bytes()
        assert data.endswith(b"\n") and len(data) <= 400
    assert [e["seq"] for e in read_events(path)] == list(range(1, 31))


def test_write_lines_rejects_a_batch_with_a_line_break_before_writing(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    with EventLog(path) as log, pytest.raises(ValueError):
        log.write_lines(['{"seq":1}', '{"seq":2}\n{"seq":3}'])
    assert path.read_bytes() == b""


# --------------------------------------------------------------------------- replay in raw chunks

# A stored line as the log may hold it: an event, an event out of order or repeated (a
# restart after a torn write), garbage, a blank line, a torn line sealed by the next writer.
stored_st = st.one_of(
    st.tuples(st.just("event"), st.integers(1, 400), st.sampled_from(["ready", "resync"]),
              st.sampled_from([None, "0000:01:00.0", "0000:02:00.0"])),
    st.tuples(st.just("garbage"), st.sampled_from(
        [b"not json", b"", b'{"seq":7,"time":"x"', b'{"seq":"8","type":"ready"}', b"[1,2]",
         b'{"seq":9,"type":"ready"} trailing', b"\xff\xfe", b'{"seq": 10, "type": "ready"}'])),
)


def stored_bytes(item: tuple[Any, ...], counter: list[int]) -> bytes:
    if item[0] == "garbage":
        return bytes(item[1])
    _, jump, etype, addr = item
    counter[0] = counter[0] + 1 if jump > 40 else max(1, counter[0] - jump % 5)
    extra = {} if addr is None else {"addr": addr}
    return line(counter[0], etype, **extra).encode()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(stored_st, max_size=60), st.integers(0, 3), st.integers(0, 30),
       st.sampled_from([None, "types", "addrs"]))
def test_chunked_replay_sends_exactly_what_read_records_reads(
    tmp_path_factory: pytest.TempPathFactory, items: list[tuple[Any, ...]], files: int,
    since: int, filtered: str | None
) -> None:
    """`read_chunks` (the socket replay) relays byte for byte the lines `read_records` decodes,
    whatever the log holds, and its seq ranges cover every event read, in order."""
    path = tmp_path_factory.mktemp("log") / "events.jsonl"
    counter = [0]
    blobs = [stored_bytes(item, counter) for item in items]
    per_file = max(1, len(blobs) // (files + 1))
    for index in range(files, -1, -1):  # PATH.files … PATH.1, PATH
        part = blobs[(files - index) * per_file:] if index == 0 else \
            blobs[(files - index) * per_file:(files - index + 1) * per_file]
        Path(eventlog.rotated_path(path, index)).write_bytes(b"".join(b + b"\n" for b in part))
    since_seq = since or None
    wanted_types = {"resync"} if filtered == "types" else None
    wanted_addrs = {"0000:01:00.0"} if filtered == "addrs" else None

    def wants(etype: str, addr: Any) -> bool:
        return ((wanted_types is None or etype in wanted_types)
                and (wanted_addrs is None or addr in wanted_addrs))

    expected = [r for r in read_records(path, since_seq=since_seq)]
    chunks = list(eventlog.read_chunks(path, since_seq=since_seq,
                                       wants=None if filtered is None else wants))
    kept = [r for r in expected if wants(r.event["type"], r.event.get("addr"))]
    assert b"".join(c.data for c in chunks) == b"".join(
        r.line.encode() + b"\n" for r in kept)
    bounds = [(c.first, c.last) for c in chunks]
    assert all(a <= b for a, b in bounds)
    assert all(b1 < a2 for (_, b1), (a2, _) in itertools.pairwise(bounds))
    if expected:
        assert bounds[0][0] == expected[0].event["seq"]
        assert bounds[-1][1] == expected[-1].event["seq"]
    else:
        assert chunks == []


def test_chunked_replay_is_one_bounded_read_per_chunk(tmp_path: Path) -> None:
    """Each chunk is one read of at most 16 KiB (plus the line the previous read ended in),
    passed on undecoded, split only at lines."""
    path = tmp_path / "events.jsonl"
    with EventLog(path, max_bytes=200_000, keep=20) as log:
        write_events(log, 1, 6000)
    chunks = list(eventlog.read_chunks(path))
    assert len(chunks) > 5 and all(len(c.data) <= 16 * 1024 + len(line(6000)) for c in chunks)
    assert all(c.data.endswith(b"}\n") for c in chunks)
    assert [c.first for c in chunks[1:]] == [c.last + 1 for c in chunks[:-1]]
    assert (chunks[0].first, chunks[-1].last) == (1, 6000)
    later = list(eventlog.read_chunks(path, since_seq=5990))
    assert b"".join(c.data for c in later).count(b"\n") == 10 and later[0].first == 5991


def test_chunked_replay_skips_an_over_long_line(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eventlog, "MAX_EVENT_LINE", 1024)
    path = tmp_path / "events.jsonl"
    long = line(2, "ready", pad="x" * 200_000)
    path.write_text(line(1) + "\n" + long + "\n" + line(3) + "\n")
    chunks = list(eventlog.read_chunks(path))
    assert b"".join(c.data for c in chunks) == (line(1) + "\n" + line(3) + "\n").encode()
    # Long but allowed: kept whole, and the lines after it are read as before.
    monkeypatch.setattr(eventlog, "MAX_EVENT_LINE", 1 << 20)
    lines = [line(1), line(2, "ready", pad="y" * 100_000), *(line(s) for s in range(3, 2000))]
    path.write_text("".join(f"{text}\n" for text in lines))
    chunks = list(eventlog.read_chunks(path))
    assert b"".join(c.data for c in chunks).decode().splitlines() == lines
    assert max(len(c.data) for c in chunks) < 200_000


def test_cli_follow_hands_over_from_the_log_to_new_events_exactly(tmp_path: Path) -> None:
    """``events --follow --since-seq N`` on a log another process writes: what the log held
    after N, then what is appended while it runs (across rotations, while the writer races
    the follower's scans), each seq once, in order, and every line exactly as stored."""
    path = tmp_path / "ev.jsonl"
    stored = {seq: line(seq, "ready" if seq % 3 else "stopped", pad="p" * (seq % 7))
              for seq in range(1, 241)}
    with EventLog(path, max_bytes=600, keep=1000) as log:
        for seq in range(1, 41):
            log.write_line(stored[seq])
        proc = _spawn_follow(path, "--since-seq", "25", "--type", "ready")
        lines = LineReader(proc)
        try:
            done = threading.Event()

            def write_rest() -> None:
                for seq in range(41, 241):
                    log.write_line(stored[seq])
                    if seq % 20 == 0:
                        time.sleep(0.01)  # let the follower meet rotations mid-scan
                done.set()

            writer = threading.Thread(target=write_rest)
            writer.start()
            want = [stored[s] + "\n" for s in range(26, 241) if s % 3]
            got = lines.raw(len(want))
            writer.join(10)
            assert done.is_set()
            assert got == want
            assert len(log_files(path)) > 10  # it really crossed rotations
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=10)
            assert proc.returncode == 0
            lines.close()
            assert lines.raw_left() == []  # nothing after the last event, no repeat
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            assert proc.stderr is not None
            proc.stderr.close()


def test_readers_and_writer_agree_on_a_rotated_name_that_is_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """``PATH.2`` is a directory between rotated files. The writer never moves, replaces or
    deletes it (its rotation is refused, the log goes on growing), and every reader (one
    shot, follower, socket replay, ``gpuwatch events``) passes over it with one warning
    and reads the files around it: before, readers stopped with EISDIR while the writer
    carried on (and moved the directory along the rotated names)."""
    path = tmp_path / "ev.jsonl"
    Path(f"{path}.3").write_text("".join(line(s) + "\n" for s in range(1, 4)))
    (tmp_path / "ev.jsonl.2").mkdir()
    (tmp_path / "ev.jsonl.2" / "theirs").write_text("x")
    Path(f"{path}.1").write_text("".join(line(s) + "\n" for s in range(4, 7)))
    path.write_text("".join(line(s) + "\n" for s in range(7, 10)))
    with caplog.at_level(logging.WARNING, logger="gpuwatch.watch.eventlog"):
        with EventLog(path, max_bytes=4 * (len(line(10)) + 1), keep=3) as log:
            assert log.last_seq == 9
            write_events(log, 10, 30)
        rotations = [r for r in caplog.records if "rotation" in r.getMessage()]
        assert rotations and "is a directory" in rotations[0].getMessage()
        assert (tmp_path / "ev.jsonl.2" / "theirs").read_text() == "x"  # left where it was
        assert seqs(read_events(path)) == list(range(1, 31))
        chunks = b"".join(c.data for c in eventlog.read_chunks(path, since_seq=2))
        assert [json.loads(t)["seq"] for t in chunks.splitlines()] == list(range(3, 31))
        col = Collector(path)
        col.wait_for(lambda events: len(events) >= 30)
        col.stop()
        assert seqs(col.events) == list(range(1, 31))
    assert last_seq_in(path) == 30
    caplog.clear()
    capsys.readouterr()
    assert run_cli([str(path)]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(t)["seq"] for t in out.splitlines()] == list(range(1, 31))
    assert err.count("\n") == 1 and "ev.jsonl.2 is a directory" in err


def test_a_rotated_name_that_is_a_link_loop_is_skipped_like_a_directory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A link at ``PATH.1`` that loops (ELOOP on open) holds no events: readers skip it with
    one warning, as the writer passes it by, instead of stopping on it."""
    path = tmp_path / "ev.jsonl"
    Path(f"{path}.2").write_text("".join(line(s) + "\n" for s in range(1, 4)))
    Path(f"{path}.1").symlink_to(f"{path.name}.1")  # itself
    path.write_text("".join(line(s) + "\n" for s in range(4, 7)))
    with caplog.at_level(logging.WARNING, logger="gpuwatch.watch.eventlog"):
        assert seqs(read_events(path)) == list(range(1, 7))
    assert [r.getMessage() for r in caplog.records if "loops" in r.getMessage()] != []
    assert last_seq_in(path) == 6


def test_a_rotated_name_that_is_a_socket_is_skipped_by_every_reader(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A UNIX socket at ``PATH.1`` cannot even be opened (ENXIO), so it never reached the
    check that tells readers to pass over what is no log file: they stopped on it. Now the
    one-shot reader, the socket replay's chunks and a follower all read around it."""
    path = tmp_path / "ev.jsonl"
    Path(f"{path}.2").write_text("".join(line(s) + "\n" for s in range(1, 4)))
    path.write_text("".join(line(s) + "\n" for s in range(4, 7)))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(f"{path}.1")
        with caplog.at_level(logging.WARNING, logger="gpuwatch.watch.eventlog"):
            assert seqs(read_events(path)) == list(range(1, 7))
            chunks = b"".join(c.data for c in eventlog.read_chunks(path, since_seq=1))
            assert [json.loads(t)["seq"] for t in chunks.splitlines()] == list(range(2, 7))
            col = Collector(path)
            col.wait_for(lambda events: len(events) >= 6)
            col.stop()
            assert seqs(col.events) == list(range(1, 7))
        assert any("is a socket" in r.getMessage() for r in caplog.records)
        assert last_seq_in(path) == 6
