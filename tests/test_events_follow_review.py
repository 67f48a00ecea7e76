"""Following the JSONL event log as other programs do while files around it are removed:
the follower neither prints an event twice nor passes over seqs without saying so."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.watch.eventlog import EventLog, follow_records

REPO = Path(__file__).resolve().parents[1]


def line(seq: int, type_: str = "resync", at: str = "2026-12-02T17:20:41.123456Z") -> str:
    event = {"seq": seq, "time": at, "type": type_, "reason": "reconcile", "changes": 0}
    return json.dumps(event, separators=(",", ":"))


def write(log: EventLog, first: int, last: int) -> None:
    for seq in range(first, last + 1):
        log.write_line(line(seq, "ready" if seq == 1 else "resync"))


def file_holding(path: Path, seq: int) -> Path:
    """The log file (PATH or PATH.N) whose lines include ``seq``."""
    wanted = f'{{"seq":{seq},'
    for name in sorted(os.listdir(path.parent)):
        candidate = path.parent / name
        if (name.startswith(path.name) and not name.endswith(".lock")
                and any(ln.startswith(wanted) for ln in candidate.read_text().splitlines())):
            return candidate
    raise AssertionError(f"no file holds seq {seq}")


def follow_until(path: Path, last: int, actions: dict[int, Any], since_seq: int | None,
                 ) -> list[int]:
    """Follow PATH until ``last`` is printed (or 10 s pass), running ``actions[seq]`` right
    after ``seq`` is printed: the follower is then between two polls."""
    got: list[int] = []
    deadline = time.monotonic() + 10
    records = follow_records(path, since_seq=since_seq, poll_interval=0.005,
                             stop=lambda: time.monotonic() > deadline)
    with contextlib.closing(records):
        for record in records:
            got.append(record.event["seq"])
            if record.event["seq"] in actions:
                actions.pop(record.event["seq"])()
            if record.event["seq"] == last or len(got) > 200:
                break
    return got


@pytest.mark.timeout(30)
@pytest.mark.parametrize("since_seq", [None, 25])
def test_a_follower_whose_file_is_deleted_among_rotated_files_prints_nothing_twice(
        tmp_path: Path, since_seq: int | None) -> None:
    """The file a follower had read to the end was rotated twice and then deleted (a
    clean-up, an outside logrotate) while older rotated files stayed. The rescan no longer
    met that file where it used to stop, walked on into the older files and, with
    ``--since-seq`` (their ``ready`` records never read), took seq 1 for a new run and
    printed 1..28 again after 32."""
    path = tmp_path / "ev.jsonl"
    log = EventLog(path, max_bytes=500, keep=100)
    write(log, 1, 30)

    def rotate_twice_and_delete_it() -> None:
        write(log, 31, 40)  # two rotations at least: the file read is PATH.2 or older now
        read_file = file_holding(path, 30)
        assert read_file.name not in (path.name, path.name + ".1")
        read_file.unlink()
        write(log, 41, 45)

    try:
        got = follow_until(path, 45, {30: rotate_twice_and_delete_it}, since_seq)
    finally:
        log.close()
    first = 1 if since_seq is None else since_seq + 1
    assert got == list(range(first, 46))


@pytest.mark.timeout(30)
def test_a_follower_says_which_seqs_it_passed_over(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The newest rotated file was deleted before the follower read it: its events are
    gone, and the follower says which seqs (was: a silent jump from 32 to 37). A ``log-gap``
    record names its own hole, so only what it does not cover is said."""
    path = tmp_path / "ev.jsonl"
    log = EventLog(path, max_bytes=500, keep=100)
    write(log, 1, 30)

    def delete_an_unread_file() -> None:
        write(log, 31, 45)
        unread = file_holding(path, 40)
        assert unread != file_holding(path, 30) and unread != path
        held = [ln["seq"] for ln in map(json.loads, unread.read_text().splitlines())]
        unread.unlink()
        skipped.extend(held)

    skipped: list[int] = []
    caplog.set_level(logging.INFO, logger="gpuwatch.watch.eventlog")
    try:
        got = follow_until(path, 45, {30: delete_an_unread_file}, 25)
    finally:
        log.close()
    assert got == [s for s in range(26, 46) if s not in skipped]
    notes = [r.getMessage() for r in caplog.records if "not in the log" in r.getMessage()]
    assert notes == [f"event log {path}: seqs {skipped[0]}-{skipped[-1]} are not in the log "
                     "(rotated out or deleted before they were read, or damaged): passed over"]


@pytest.mark.timeout(30)
def test_a_log_gap_record_is_not_said_again_but_what_it_misses_is(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "ev.jsonl"
    gap = json.dumps({"seq": 20, "time": "2026-12-02T17:20:42.000000Z", "type": "log-gap",
                      "first_seq": 14, "last_seq": 20, "error": "ENOSPC"}, separators=(",", ":"))
    path.write_text("".join(line(s) + "\n" for s in range(1, 11)) + gap + "\n"
                    + line(21) + "\n")
    caplog.set_level(logging.INFO, logger="gpuwatch.watch.eventlog")
    got = follow_until(path, 21, {}, None)
    assert got == [*range(1, 11), 20, 21]
    notes = [r.getMessage() for r in caplog.records if "not in the log" in r.getMessage()]
    assert len(notes) == 1 and "seqs 11-13 " in notes[0]


@pytest.mark.timeout(60)
def test_gpuwatch_events_follow_names_the_hole_on_stderr_and_prints_no_repeat(
        tmp_path: Path) -> None:
    """The same through ``gpuwatch events --follow --since-seq`` in its own process, a
    writer rotating and a clean-up deleting files while it runs."""
    path = tmp_path / "ev.jsonl"
    log = EventLog(path, max_bytes=500, keep=100)
    write(log, 1, 30)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwatch", "events", str(path), "--follow", "--since-seq", "25"],
        cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout is not None and proc.stderr is not None
        got = [json.loads(proc.stdout.readline())["seq"] for _ in range(5)]
        # Stopped while the writer rotates and the clean-up deletes, so that it sees them
        # all at once, as a follower slower than both would (else it may read 31-45 first).
        proc.send_signal(signal.SIGSTOP)
        try:
            write(log, 31, 45)
            read_file = file_holding(path, 30)
            unread = file_holding(path, 40)
            read_file.unlink()  # the file it stopped in, with older files left behind it
            unread.unlink()
            write(log, 46, 50)
        finally:
            proc.send_signal(signal.SIGCONT)
        while got[-1] != 50:
            got.append(json.loads(proc.stdout.readline())["seq"])
        proc.terminate()
        assert proc.wait(timeout=20) == 0
        err = proc.stderr.read()
    finally:
        log.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    assert got == sorted(set(got)) and got[:5] == list(range(26, 31))
    assert 40 not in got and err.count("are not in the log") == 1, err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("put", ["fifo", "directory"])
def test_a_follower_prints_what_its_file_still_held_before_saying_the_path_is_no_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, put: str) -> None:
    """Lines written just before the log file was moved away and something that is no log
    file put at its name (between the follower's last empty read and its look at the
    directory) are still printed, then the path is refused."""
    import gpuwatch.watch.eventlog as eventlog_mod

    path = tmp_path / "ev.jsonl"
    with path.open("w") as f:
        f.writelines(line(seq, "ready" if seq == 1 else "resync") + "\n" for seq in range(1, 6))
    armed = [False]
    real_stat_ident = eventlog_mod._stat_ident

    def racing_stat_ident(name: str) -> Any:
        if armed[0] and name == str(path):
            armed[0] = False  # the writer's last lines, the move, and a stranger at the name
            with path.open("a") as f:
                f.writelines(line(seq) + "\n" for seq in range(6, 11))
            path.rename(tmp_path / "ev.jsonl.moved")
            os.mkfifo(path) if put == "fifo" else path.mkdir()
        return real_stat_ident(name)

    monkeypatch.setattr(eventlog_mod, "_stat_ident", racing_stat_ident)
    got: list[int] = []
    records = follow_records(path, poll_interval=0.005)
    with contextlib.closing(records), pytest.raises(OSError) as info:
        for record in records:
            got.append(record.event["seq"])
            if record.event["seq"] == 5:
                armed[0] = True
    assert got == list(range(1, 11))
    assert str(path) in str(info.value)
