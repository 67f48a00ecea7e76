"""The event log under outside hands: PATH deleted or renamed away under the writer (it
reopens PATH), two writers reaching one log by other names, unreadable rotated files, and a
junk tail that must not make finding the last seq slow."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from watch_helpers import count_calls

from gpuwatch.watch import eventlog
from gpuwatch.watch.eventlog import EventLog, EventLogLocked, EventLogWriteError, read_events

TIME = "2026-12-02T17:20:41.123456Z"


def line(seq: int, type_: str = "ready", **extra: Any) -> str:
    return json.dumps({"seq": seq, "time": TIME, "type": type_, **extra}, separators=(",", ":"))


def write_events(log: EventLog, first: int, last: int) -> None:
    for seq in range(first, last + 1):
        log.write_line(line(seq))


def seqs_in(path: Path) -> list[int]:
    return [event["seq"] for event in read_events(path)]


def test_a_log_deleted_under_the_writer_is_made_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``rm PATH`` under a running watcher: its later events went to the deleted file, where
    no reader could see them. Now the next batch recreates PATH, said in one warning."""
    path = tmp_path / "ev.jsonl"
    with caplog.at_level(logging.WARNING, logger="gpuwatch.watch.eventlog"), EventLog(path) as log:
        write_events(log, 1, 3)
        path.unlink()
        write_events(log, 4, 6)
        assert seqs_in(path) == [4, 5, 6]
    warnings = [r.getMessage() for r in caplog.records if "deleted" in r.getMessage()]
    assert len(warnings) == 1 and "reopening" in warnings[0]


def test_a_log_renamed_away_like_logrotate_create_is_followed_to_the_new_file(
    tmp_path: Path,
) -> None:
    """logrotate's ``create`` mode (``mv PATH PATH.old; touch PATH``): the writer moves to
    the new PATH instead of filling PATH.old, and a torn line found there is ended first."""
    path = tmp_path / "ev.jsonl"
    old = tmp_path / "ev.jsonl.old"
    with EventLog(path) as log:
        write_events(log, 1, 3)
        path.rename(old)
        path.write_text('{"theirs":1}\n{"seq":9')  # someone else's, torn
        write_events(log, 4, 5)
    assert seqs_in(old) == [1, 2, 3]
    assert path.read_text().splitlines() == ['{"theirs":1}', '{"seq":9', line(4), line(5)]


@pytest.mark.timeout(30)
def test_a_log_renamed_away_is_not_said_to_be_deleted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``mv PATH PATH.old`` with nothing at PATH yet: the line on stderr said "deleted under
    the writer", sending an operator to look for lost events that are in PATH.old."""
    path = tmp_path / "ev.jsonl"
    with caplog.at_level(logging.WARNING, logger="gpuwatch.watch.eventlog"), EventLog(path) as log:
        write_events(log, 1, 3)
        path.rename(tmp_path / "ev.jsonl.old")
        write_events(log, 4, 4)
    said = [r.getMessage() for r in caplog.records if "under the writer" in r.getMessage()]
    assert said == [f"event log {path}: renamed away under the writer; reopening {path}"]
    assert seqs_in(path) == [4]


def test_what_replaces_the_log_that_is_no_file_is_not_written(tmp_path: Path) -> None:
    """A FIFO (with a reader) put where the log file was is not the log's: the write fails
    (the watcher degrades the log) and the FIFO's reader gets nothing; once a file is back
    the writes go on there."""
    path = tmp_path / "ev.jsonl"
    with EventLog(path) as log:
        write_events(log, 1, 2)
        path.unlink()
        os.mkfifo(path)
        reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            with pytest.raises(EventLogWriteError, match="is a FIFO"):
                write_events(log, 3, 3)
            with pytest.raises(EventLogWriteError, match="is a FIFO"):  # the retry too
                write_events(log, 3, 3)
            try:
                received = os.read(reader, 100)
            except BlockingIOError:
                received = b""
            assert received == b""  # nothing was written into it
        finally:
            os.close(reader)
        path.unlink()
        write_events(log, 3, 4)
    assert seqs_in(path) == [3, 4]


def test_noticing_a_moved_log_costs_one_stat_a_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write path is hot: PATH is looked at once per batch, not once per line."""
    path = tmp_path / "ev.jsonl"
    with EventLog(path) as log:
        write_events(log, 1, 1)
        calls = count_calls(monkeypatch, eventlog.os, "stat")
        log.write_lines([line(seq) for seq in range(2, 202)])
        monkeypatch.undo()
    assert calls == [os.fspath(path)]
    assert seqs_in(path) == list(range(1, 202))


def test_a_second_writer_through_a_link_to_the_log_is_refused(tmp_path: Path) -> None:
    """The lock was taken beside the name given: a watcher naming the same file through a
    link locked ``link.lock`` and both wrote one file (interleaved, seqs repeated). Now the
    lock is beside the file the log really is."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    real = tmp_path / "a" / "ev.jsonl"
    link = tmp_path / "b" / "ev.jsonl"
    link.symlink_to(real)  # dangling until the first writer makes the file
    with EventLog(link) as first:
        write_events(first, 1, 1)
        with pytest.raises(EventLogLocked) as refused:
            EventLog(real)
        assert str(refused.value) == (
            f"event log {real} is written by pid {os.getpid()} (it holds {real}.lock); "
            "one log has one writer")
        assert not (tmp_path / "b" / "ev.jsonl.lock").exists()
    with EventLog(real) as again:  # released with the first writer
        assert again.last_seq == 1


def refused_as_held(tmp_path: Path, name: Path) -> str:
    with pytest.raises(EventLogLocked) as refused:
        EventLog(name)
    return str(refused.value)


@pytest.mark.timeout(30)
def test_a_rotation_of_a_linked_log_keeps_one_writer(tmp_path: Path) -> None:
    """``--log`` names a link: the first rotation renames the link itself and makes a
    regular PATH, whose ``PATH.lock`` nobody held, so a second watcher ran beside the
    first. The file written is flocked too now: the second one is refused."""
    (tmp_path / "real").mkdir()
    (tmp_path / "logs").mkdir()
    real = tmp_path / "real" / "ev.jsonl"
    real.touch()
    link = tmp_path / "logs" / "ev.jsonl"
    link.symlink_to(real)
    with EventLog(link, max_bytes=300, keep=3) as first:
        write_events(first, 1, 8)
        assert not link.is_symlink()  # rotated: the link is ev.jsonl.1 now
        message = refused_as_held(tmp_path, link)
        assert message == (f"event log {link} is written by pid {os.getpid()} (it holds the "
                           "file itself locked); one log has one writer")
        write_events(first, 9, 9)
    assert seqs_in(link)[-1] == 9


@pytest.mark.timeout(30)
def test_a_log_swapped_for_a_link_to_another_writers_log_is_not_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``a.jsonl`` replaced by a link to ``b.jsonl``, which another writer holds: the reopen
    followed the link and both wrote ``b.jsonl``. Now the write fails (the log degrades),
    said once, and goes on once ``a.jsonl`` is a file of its own again."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    with caplog.at_level(logging.WARNING, logger="gpuwatch.watch.eventlog"), \
            EventLog(a) as writer_a, EventLog(b) as writer_b:
        write_events(writer_a, 1, 2)
        write_events(writer_b, 1, 2)
        (tmp_path / "tmp").symlink_to("b.jsonl")
        (tmp_path / "tmp").replace(a)
        for _ in range(3):  # the retries fail too, silently
            with pytest.raises(EventLogWriteError, match=f"written by pid {os.getpid()}"):
                write_events(writer_a, 3, 3)
        write_events(writer_b, 3, 3)
        assert seqs_in(b) == [1, 2, 3]
        a.unlink()
        write_events(writer_a, 4, 4)
    assert seqs_in(a) == [4]
    held = [r.getMessage() for r in caplog.records if "another writer" in r.getMessage()]
    assert held == [f"event log {a}: the file it names now is written by pid {os.getpid()}, "
                    "another writer; not written while it is"]


@pytest.mark.timeout(30)
def test_a_log_directory_made_anew_keeps_one_writer(tmp_path: Path) -> None:
    """The log's directory renamed away and made again: the writer reopens PATH there, where
    no ``PATH.lock`` is held, and a second watcher on PATH ran. Now it is refused."""
    logs = tmp_path / "logs"
    logs.mkdir()
    path = logs / "ev.jsonl"
    with EventLog(path) as first:
        write_events(first, 1, 2)
        logs.rename(tmp_path / "logs.old")
        logs.mkdir()
        write_events(first, 3, 3)
        assert "is written by pid" in refused_as_held(tmp_path, path)
    assert seqs_in(path) == [3]


@pytest.mark.timeout(30)
def test_one_log_file_under_two_hard_linked_names_has_one_writer(tmp_path: Path) -> None:
    """Two names in two directories for one file: each name's ``PATH.lock`` differs, and
    both wrote the one file. The file's own flock refuses the second, exit 2's error."""
    (tmp_path / "d1").mkdir()
    (tmp_path / "d2").mkdir()
    one = tmp_path / "d1" / "a.jsonl"
    one.touch()
    os.link(one, tmp_path / "d2" / "b.jsonl")
    with EventLog(one) as first:
        write_events(first, 1, 1)
        refused_as_held(tmp_path, tmp_path / "d2" / "b.jsonl")
    with EventLog(tmp_path / "d2" / "b.jsonl") as again:  # released with the first writer
        assert again.last_seq == 1


def no_lock_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lock files cannot be made (a disk out of space or inodes), as for the fallback."""
    real_open = os.open

    def full_disk_open(name: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if os.fspath(name).endswith(".lock") and flags & os.O_CREAT and not os.path.exists(name):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
        return real_open(name, flags, *args, **kwargs)

    monkeypatch.setattr(eventlog.os, "open", full_disk_open)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("fallback_first", [True, False])
def test_the_full_disk_directory_lock_conflicts_with_the_lock_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fallback_first: bool
) -> None:
    """A writer that could not make ``PATH.lock`` locks the directory instead; a second
    writer of that log that could make ``PATH.lock`` later ran beside it. Every writer now
    holds its directory shared, so either one comes first and the other is refused, each
    in words that name what is locked (no lock file that does not exist) and its holder."""
    path = tmp_path / "ev.jsonl"
    other = tmp_path / "other.jsonl"
    fds = open_fds()
    with monkeypatch.context() as patch:
        if fallback_first:
            no_lock_file(patch)
        first = EventLog(path)
    try:
        assert (path.with_name("ev.jsonl.lock").exists()) is not fallback_first
        with monkeypatch.context() as patch:
            if not fallback_first:
                no_lock_file(patch)
                os.unlink(f"{path}.lock")  # removed under its holder: only the directory is left
            with pytest.raises(EventLogLocked) as refused:
                EventLog(path)
        message = str(refused.value)
        if fallback_first:
            assert message == (
                f"event log {path}: its directory {tmp_path} is locked by pid {os.getpid()}, "
                "a writer there that could not make its lock file (a full disk); one log "
                "has one writer")
            with pytest.raises(EventLogLocked, match=r"its directory .* is locked by pid"):
                EventLog(other)  # the fallback's price: the directory's other logs wait
        else:
            assert message == (
                f"event log {path}: its lock {path}.lock cannot be made (ENOSPC: "
                f"{os.strerror(errno.ENOSPC)}), and {tmp_path}, locked instead, has another "
                f"writer (pid {os.getpid()}); one log has one writer")
            EventLog(other).close()  # lock files side by side: no conflict
    finally:
        first.close()
    assert open_fds() == fds  # the refused writers closed what they opened
    with EventLog(path) as again:
        write_events(again, 1, 1)


def unreadable(monkeypatch: pytest.MonkeyPatch, *names: Path) -> None:
    """Opening ``names`` for reading fails with EACCES (a file of another user, as a root
    without DAC override meets it), whoever runs the tests."""
    real_open = os.open
    denied = {os.fspath(name) for name in names}

    def open_denied(name: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if os.fspath(name) in denied and not flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), name)
        return real_open(name, flags, *args, **kwargs)

    monkeypatch.setattr(eventlog.os, "open", open_denied)


def rotated_log(tmp_path: Path) -> Path:
    """PATH.2 with seqs 1-3, PATH.1 with 4-5, PATH with 6-8."""
    path = tmp_path / "ev.jsonl"
    for name, first, last in ((f"{path}.2", 1, 3), (f"{path}.1", 4, 5), (path, 6, 8)):
        Path(name).write_text("".join(line(seq) + "\n" for seq in range(first, last + 1)))
    return path


def test_an_unreadable_rotated_file_is_a_hole_not_the_end_of_every_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """EACCES on PATH.1 stopped every reader with a bare PermissionError: a one-shot read,
    a socket replay (answered ``unavailable``, even for seqs PATH alone holds) and
    ``gpuwatch events --since-seq``. It is a hole: the files around it are read, with one
    warning, and a replay's chunks jump over it as over a missing file."""
    from test_eventlog import run_cli

    path = rotated_log(tmp_path)
    unreadable(monkeypatch, Path(f"{path}.1"))
    with caplog.at_level(logging.WARNING, logger="gpuwatch.watch.eventlog"):
        assert seqs_in(path) == [1, 2, 3, 6, 7, 8]
        chunks = [(c.first, c.last) for c in eventlog.read_chunks(path, since_seq=1)]
        assert chunks == [(2, 3), (6, 8)]
        assert [(c.first, c.last) for c in eventlog.read_chunks(path, since_seq=6)] == [(7, 8)]
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings and all(f"{path}.1 cannot be read: EACCES" in w for w in warnings)
    caplog.clear()
    capsys.readouterr()
    assert run_cli([str(path), "--since-seq", "6"]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(text)["seq"] for text in out.splitlines()] == [7, 8]
    assert err.count("\n") == 1 and "cannot be read" in err


def test_an_unreadable_log_file_itself_is_still_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a rotated file is read around: PATH itself unreadable is said, not skipped."""
    path = rotated_log(tmp_path)
    unreadable(monkeypatch, path)
    with pytest.raises(PermissionError):
        list(read_events(path))


def test_finding_the_last_seq_decodes_no_line_of_a_junk_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 MiB of ``{}`` lines after the last event took 10 s (each line decoded) and held a
    starting daemon that long. Only lines that start as records are decoded now."""
    path = tmp_path / "ev.jsonl"
    with path.open("wb") as f:
        f.write((line(6) + "\n" + line(7) + "\n").encode())
        f.write(b"{}\n" * ((16 << 20) // 3))
    decoded = count_calls(monkeypatch, eventlog, "_decode")
    assert eventlog.last_seq_in(path) == 7
    assert decoded == [line(7).encode()]


def test_past_the_scan_bound_the_last_seq_is_given_up_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The search backwards is bounded (`LAST_SEQ_SCAN`): past it, with no event in the
    file's first 64 KiB nor in an older file either, the log is taken to hold no event
    (numbering from 1, said once) instead of reading on."""
    path = tmp_path / "ev.jsonl"
    path.write_bytes(b"x" * 70_000 + b"\n" + (line(7) + "\n").encode() + b"\n" * (1 << 20))
    monkeypatch.setattr(eventlog, "LAST_SEQ_SCAN", 256 << 10)
    with caplog.at_level(logging.WARNING, logger="gpuwatch.watch.eventlog"):
        assert eventlog.last_seq_in(path) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"event log {path}: no event in the last 0 MiB of {path}; numbering as if the log "
        "held none"]
    monkeypatch.setattr(eventlog, "LAST_SEQ_SCAN", 2 << 20)
    assert eventlog.last_seq_in(path) == 7


@pytest.mark.parametrize("pad", [0, 1, 5, 6, 7, 100, 65_530, 65_536, 70_000, 200_000])
def test_the_last_seq_is_the_last_decodable_line_wherever_chunks_cut(
    pad: int,
) -> None:
    """The search finds what decoding every line backwards found: record starts cut by a
    chunk's edge, a line longer than a chunk, damaged records, a torn tail, a record as
    the file's first line."""
    import io

    cases = [
        b"x" * pad + b"\n" + line(5).encode() + b"\n",
        (line(3) + "\n" + line(4, pad="y" * pad) + "\n").encode() + b'{"seq":9,"ty\n',
        line(2).encode() + b"\n" + b"z" * pad + b'\n{"seq":8,"time":"t","type":"x"}' ,
        b'{"seq": 11, "time": "t", "type": "ready"}\n' + b"{}\n" * pad,
        b"q" * pad,
        (line(12) + "\n").encode() + b"\n" * pad + b'{"seq":13}\n',
    ]
    for data in cases:
        expected = None
        for raw in eventlog._reverse_lines(io.BytesIO(data)):
            found = eventlog._decode(raw)
            if found is not None:
                expected = found[0]["seq"]
                break
        assert eventlog._last_seq_of(io.BytesIO(data)) == expected, data[:80]
