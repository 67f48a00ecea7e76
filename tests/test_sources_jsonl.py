"""The JSONL file source (regular file and FIFO), uevent_to_json, and ``gpuwatch record``."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import anyio
import pytest

from gpuwatch.cli import record_cmd
from gpuwatch.cli.record_cmd import record
from gpuwatch.core.uevent import UEvent
from gpuwatch.sources import SourceOverflow, SourceUnavailable, open_source
from gpuwatch.sources.jsonl import JsonlFileSource, uevent_to_json

REPO = Path(__file__).resolve().parent.parent


def props(i: int, action: str = "change") -> dict[str, str]:
    return {
        "ACTION": action,
        "DEVPATH": f"/devices/pci0000:00/0000:00:{i % 32:02x}.0",
        "SUBSYSTEM": "pci",
        "PCI_SLOT_NAME": f"0000:00:{i % 32:02x}.0",
        "SEQNUM": str(1000 + i),
    }


def write_jsonl(path: Path, maps: Iterable[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(m) + "\n" for m in maps), encoding="utf-8")


async def collect(source: JsonlFileSource, seconds: float = 10) -> list[list[UEvent]]:
    """All batches until EOF; overflow markers are a bug for a file source."""
    batches: list[list[UEvent]] = []
    with anyio.fail_after(seconds):
        async for item in source.batches():
            assert not isinstance(item, SourceOverflow)
            batches.append(item)
    return batches


def flat(batches: list[list[UEvent]]) -> list[dict[str, str]]:
    return [dict(ev.properties) for batch in batches for ev in batch]


async def read_all(path: Path) -> list[dict[str, str]]:
    """Every event of the file at ``path``, through a source of its own."""
    src = JsonlFileSource(path)
    try:
        return flat(await collect(src))
    finally:
        src.close()


# --- regular files -------------------------------------------------------------------------


async def test_regular_file_delivers_every_event_in_order(tmp_path: Path) -> None:
    maps = [props(i) for i in range(100)]
    path = tmp_path / "ev.jsonl"
    write_jsonl(path, maps)
    src = JsonlFileSource(path)
    try:
        batches = await collect(src)
    finally:
        src.close()
    assert flat(batches) == maps
    ev = batches[0][0]
    assert (ev.action, ev.devpath, ev.subsystem) == ("change", maps[0]["DEVPATH"], "pci")
    # A small file is one chunk, hence one batch: the watcher applies it in one go.
    assert len(batches) == 1


async def test_lines_split_across_chunks_are_reassembled(tmp_path: Path) -> None:
    maps = [props(i) for i in range(50)]
    path = tmp_path / "ev.jsonl"
    write_jsonl(path, maps)
    src = JsonlFileSource(path, chunk_size=7)  # every line straddles several chunks
    try:
        batches = await collect(src)
    finally:
        src.close()
    assert flat(batches) == maps
    assert len(batches) > 1


async def test_last_line_without_newline_counts(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    path.write_text(json.dumps(props(1)) + "\n" + json.dumps(props(2)), encoding="utf-8")
    src = JsonlFileSource(path)
    try:
        assert flat(await collect(src)) == [props(1), props(2)]
    finally:
        src.close()


async def test_empty_file_ends_without_batches(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    src = JsonlFileSource(path)
    try:
        assert await collect(src) == []
    finally:
        src.close()


async def test_dev_null_ends_without_batches() -> None:
    """``/dev/null`` is a character device epoll refuses (EPERM), for root and users alike."""
    src = JsonlFileSource("/dev/null")
    try:
        assert await collect(src) == []
    finally:
        src.close()


def test_a_line_nested_deeper_than_the_parser_recurses_is_malformed() -> None:
    from gpuwatch.sources.jsonl import MalformedLine, parse_jsonl_line

    deep = '{"ACTION": "add", "X": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(MalformedLine, match="not JSON"):
        parse_jsonl_line(deep.encode())


async def test_malformed_lines_are_skipped_and_the_rest_delivered(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = [props(i) for i in range(4)]
    lines = [
        json.dumps(good[0]),
        "{not json",  # 2
        "[1, 2, 3]",  # 3: not an object
        '"a string"',  # 4
        json.dumps(good[1]),
        '{"ACTION": "add", "NESTED": {"a": "b"}}',  # 6: non-scalar value
        '{"ACTION": "add", "X": null}',  # 7
        '{"ACTION": "add", "X": true}',  # 8: a bool is not a number
        "",  # 9: blank lines are spacing, not errors
        json.dumps(good[2]),
        '{"ACTION": "add", "DEVPATH": "/devices/x", "SUBSYSTEM": "pci", "SEQNUM": 42, "F": 1.5}',
        json.dumps(good[3]),
    ]
    path = tmp_path / "ev.jsonl"
    data = "\n".join(lines).encode() + b"\n" + b'{"ACTION": "\xff\xfe"}\n'  # bad UTF-8
    path.write_bytes(data)
    caplog.set_level(logging.WARNING, logger="gpuwatch.sources")
    got = await read_all(path)
    numbers = {
        "ACTION": "add",
        "DEVPATH": "/devices/x",
        "SUBSYSTEM": "pci",
        "SEQNUM": "42",
        "F": "1.5",
    }
    assert got == [good[0], good[1], good[2], numbers, good[3]]
    skipped = [r.getMessage() for r in caplog.records if "malformed uevent line" in r.getMessage()]
    assert len(skipped) == 7  # lines 2, 3, 4, 6, 7, 8 and the bad UTF-8 one; not the blank
    assert any(f"{path}:2:" in m for m in skipped)
    assert any(f"{path}:13:" in m for m in skipped)


async def test_a_file_of_garbage_is_a_bounded_number_of_warnings(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Twenty thousand malformed lines around two good ones: the first ten are named, the
    rest held back (a line per line would flood the journal, and block a daemon whose
    stderr is a full pipe), the total comes at the end, and the good lines still count."""
    good = [props(0), props(1)]
    garbage = [f"not json {i}" for i in range(20_000)]
    path = tmp_path / "garbage.jsonl"
    path.write_text("\n".join([*garbage[:10_000], json.dumps(good[0]), *garbage[10_000:],
                               json.dumps(good[1])]) + "\n")
    caplog.set_level(logging.WARNING, logger="gpuwatch.sources")
    got = await read_all(path)
    assert got == good
    messages = [r.getMessage() for r in caplog.records]
    named = [m for m in messages if "malformed uevent line skipped" in m]
    assert named[:10] == [f"{path}:{n}: malformed uevent line skipped: not JSON: Expecting "
                          "value: line 1 column 1 (char 0)" for n in range(1, 11)]
    assert len(messages) <= 20  # a burst of ten, then one a second of a run this short
    assert messages[-1] == f"{path}: 20000 malformed line(s) skipped"


async def test_over_long_line_is_skipped_without_holding_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line over the cap (a binary file, a lost newline) is dropped with its line number,
    whether it arrives whole in one chunk or across many; its neighbours still count."""
    from gpuwatch.sources import jsonl

    monkeypatch.setattr(jsonl, "MAX_LINE", 300)
    good = [props(i) for i in range(3)]
    path = tmp_path / "ev.jsonl"
    path.write_text(json.dumps(good[0]) + "\n" + "x" * 2000 + "\n" + json.dumps(good[1])
                    + "\n" + '{"ACTION": "' + "y" * 400 + '"}\n' + json.dumps(good[2]))
    caplog.set_level(logging.WARNING, logger="gpuwatch.sources")
    for chunk_size in (64, 1 << 20):
        caplog.clear()
        src = JsonlFileSource(path, chunk_size=chunk_size)
        try:
            assert flat(await collect(src)) == good
        finally:
            src.close()
        skipped = [r.getMessage() for r in caplog.records
                   if "longer than 300 bytes" in r.getMessage()]
        assert [m.split(": ")[0] for m in skipped] == [f"{path}:2", f"{path}:4"]


async def test_round_trip_uevent_to_json_through_the_source(tmp_path: Path) -> None:
    events = [
        UEvent.from_properties(props(1, "add")),
        UEvent.from_properties(
            {
                "ACTION": "bind",
                "DEVPATH": "/devices/a b",
                "SUBSYSTEM": "pci",
                "DRIVER": "vfio-pci",
                "WEIRD": 'quote " \\ tab\t é ✓',
            }
        ),
        # Missing keys are filled from the UEvent fields by to_properties.
        UEvent(action="remove", devpath="/devices/virtual/drm/card1", subsystem="drm"),
    ]
    lines = [uevent_to_json(ev) for ev in events]
    for line in lines:
        assert "\n" not in line and ": " not in line and ", " not in line
        assert list(json.loads(line)) == sorted(json.loads(line))
    path = tmp_path / "rt.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    src = JsonlFileSource(path)
    try:
        got = [ev for batch in await collect(src) for ev in batch]
    finally:
        src.close()
    assert [ev.to_properties() for ev in got] == [ev.to_properties() for ev in events]
    assert [(ev.action, ev.devpath, ev.subsystem) for ev in got] == [
        (ev.action, ev.devpath, ev.subsystem) for ev in events
    ]


async def test_large_replay_delivers_every_event_in_big_batches(tmp_path: Path) -> None:
    """Throughput is measured in benchmarks/ (storm); here: nothing lost, batched reads."""
    n = 20_000
    line = uevent_to_json(UEvent.from_properties({**props(3), "DRIVER": "vfio-pci"})) + "\n"
    path = tmp_path / "big.jsonl"
    path.write_text(line * n, encoding="utf-8")
    src = JsonlFileSource(path)
    try:
        batches = await collect(src, seconds=60)
    finally:
        src.close()
    assert sum(len(b) for b in batches) == n
    assert len(batches) < n / 100  # chunked reads, not one batch per line


# --- FIFOs ---------------------------------------------------------------------------------


async def test_fifo_with_a_slow_writer_streams_then_ends_at_eof(tmp_path: Path) -> None:
    fifo = tmp_path / "ev.fifo"
    os.mkfifo(fifo)
    maps = [props(i) for i in range(5)]
    writer_done = threading.Event()

    def writer() -> None:
        time.sleep(0.2)  # connect well after the source started waiting
        with open(fifo, "w", encoding="utf-8") as f:
            for m in maps:
                f.write(json.dumps(m) + "\n")
                f.flush()
                time.sleep(0.1)
        writer_done.set()

    src = JsonlFileSource(fifo)
    src.start()  # must not block although no writer is connected yet
    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    got: list[dict[str, str]] = []
    first_before_eof = None
    try:
        with anyio.fail_after(10):
            async for item in src.batches():
                assert not isinstance(item, SourceOverflow)
                if first_before_eof is None:
                    first_before_eof = not writer_done.is_set()
                got.extend(dict(ev.properties) for ev in item)
    finally:
        src.close()
        thread.join(5)
    assert got == maps
    assert writer_done.is_set()  # the iterator ended at EOF, not earlier
    assert first_before_eof, "events must arrive while the writer is still writing"


async def test_waiting_for_a_fifo_writer_does_not_block_the_loop(tmp_path: Path) -> None:
    fifo = tmp_path / "ev.fifo"
    os.mkfifo(fifo)
    src = JsonlFileSource(fifo)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.01)
            ticks += 1

    def writer() -> None:
        time.sleep(0.3)
        with open(fifo, "w", encoding="utf-8") as f:
            f.write(json.dumps(props(7)) + "\n")

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            got = flat(await collect(src))
            tg.cancel_scope.cancel()
    finally:
        src.close()
        thread.join(5)
    assert got == [props(7)]
    assert ticks >= 10  # the loop kept running during the 0.3 s wait for a writer


async def test_close_ends_a_batches_waiting_on_a_silent_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "ev.fifo"
    os.mkfifo(fifo)
    src = JsonlFileSource(fifo)
    ended = False

    async def consume() -> None:
        nonlocal ended
        async for _ in src.batches():
            pass
        ended = True

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.sleep(0.1)
            src.close()
    assert ended


# --- opening -------------------------------------------------------------------------------


def test_open_source_file_spec(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    path.write_text("", encoding="utf-8")
    src = open_source(f"file:{path}", tmp_path)
    assert isinstance(src, JsonlFileSource)
    assert src.name == "file"
    with pytest.raises(SourceUnavailable, match="does not exist"):
        open_source(f"file:{tmp_path / 'missing.jsonl'}", tmp_path)
    with pytest.raises(SourceUnavailable, match="needs a path"):
        open_source("file:", tmp_path)


def test_an_event_file_that_cannot_be_reached_is_not_said_missing(tmp_path: Path) -> None:
    """A path that is there but cannot be looked up (a link loop here; a folder the user
    may not search, for a non-root user) was "does not exist": the user is sent looking
    for a file that exists. The error names the real reason."""
    loop = tmp_path / "loop.jsonl"
    loop.symlink_to(loop)
    with pytest.raises(SourceUnavailable, match="levels of symbolic links") as caught:
        open_source(f"file:{loop}", tmp_path)
    assert "does not exist" not in str(caught.value)
    (tmp_path / "dangling.jsonl").symlink_to(tmp_path / "nowhere")
    with pytest.raises(SourceUnavailable, match="does not exist"):
        open_source(f"file:{tmp_path / 'dangling.jsonl'}", tmp_path)


def test_a_directory_is_not_an_event_file(tmp_path: Path) -> None:
    src = JsonlFileSource(tmp_path)
    with pytest.raises(SourceUnavailable, match="directory"):
        src.start()


# --- gpuwatch record -----------------------------------------------------------------------


async def test_record_writes_the_file_source_format(tmp_path: Path) -> None:
    maps = [props(1, "add"), props(2, "bind"), props(3, "remove")]
    path = tmp_path / "in.jsonl"
    write_jsonl(path, maps)
    src = JsonlFileSource(path)
    out = io.StringIO()
    try:
        with anyio.fail_after(10):
            written = await record(src, out, limit=3)
    finally:
        src.close()
    assert written == 3
    lines = out.getvalue().splitlines()
    assert [json.loads(line) for line in lines] == maps
    assert lines == [json.dumps(m, separators=(",", ":"), sort_keys=True) for m in maps]


async def test_record_stops_at_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    write_jsonl(path, [props(i) for i in range(3)])
    src = JsonlFileSource(path)
    out = io.StringIO()
    try:
        with anyio.fail_after(10):
            assert await record(src, out, limit=2) == 2
    finally:
        src.close()
    assert [json.loads(line) for line in out.getvalue().splitlines()] == [props(0), props(1)]


async def test_record_says_a_storm_of_losses_in_a_bounded_number_of_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """500 losses between the events of a recording: every event is recorded, and the
    gaps are named a burst of times, then held back (a line per loss would flood stderr)."""
    from gpuwatch.sources.memory import MemorySource

    src = MemorySource()
    maps = [props(i) for i in range(50)]
    for i, m in enumerate(maps):
        src.push(m)
        for _ in range(10 if i % 2 else 0):
            src.overflow()
    src.end()
    out = io.StringIO()
    caplog.set_level(logging.WARNING, logger="gpuwatch.sources")
    try:
        with anyio.fail_after(10):
            written = await record(src, out)
    finally:
        src.close()
    assert written == 50
    assert [json.loads(line) for line in out.getvalue().splitlines()] == maps
    gaps = [r.getMessage() for r in caplog.records if "the recording has a gap" in r.getMessage()]
    assert 1 <= len(gaps) <= 25, len(gaps)  # of 250 losses
    assert gaps[0] == ("record: events were lost (ENOBUFS: No buffer space available; 0 queued "
                       "dropped); the recording has a gap")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpuwatch")
    record_cmd.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["record", *argv])


def test_record_command_copies_a_file_source_to_out(tmp_path: Path) -> None:
    maps = [props(i) for i in range(3)]
    src = tmp_path / "in.jsonl"
    write_jsonl(src, maps)
    out = tmp_path / "out.jsonl"
    args = _parse(["--root", str(tmp_path), "--source", f"file:{src}", "--out", str(out)])
    assert args.func(args) == 0
    assert [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()] == maps


@pytest.mark.parametrize("spec", ["bogus", "udev", "file:/nonexistent/x.jsonl"])
def test_record_command_rejects_an_unusable_source_in_one_line(
    tmp_path: Path, spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _parse(["--root", str(tmp_path), "--source", spec, "--out", str(tmp_path / "o")])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "record:" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_record_command_reports_a_full_disk_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The close after a failed write fails again: that must not become a traceback."""
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [props(i) for i in range(3)])
    args = _parse(["--root", str(tmp_path), "--source", f"file:{src}", "--out", "/dev/full"])
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "/dev/full" in err and "No space left" in err


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="needs /proc/self/mem")
def test_record_command_reports_an_unreadable_source_as_a_read_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``file:`` source whose read fails (EIO: reading at address 0 of /proc/self/mem,
    as a failing disk would) was reported as "cannot write stdout"."""
    out = tmp_path / "out.jsonl"
    args = _parse(["--root", str(tmp_path), "--source", "file:/proc/self/mem",
                   "--out", str(out)])
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "cannot read event file '/proc/self/mem'" in err and "Input/output error" in err
    assert out.read_bytes() == b""


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="needs /proc/self/mem")
def test_watch_reports_an_unreadable_source_in_one_line(tmp_path: Path) -> None:
    """The same read error under ``watch``: one line naming the file, exit 1, not an
    "internal error: OSError"."""
    from gpuwatch.testing.machines import single_gpu_desktop

    single_gpu_desktop(tmp_path / "root")
    proc = subprocess.run(
        [sys.executable, "-m", "gpuwatch", "watch", "--root", str(tmp_path / "root"),
         "--source", "file:/proc/self/mem"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == ("gpuwatch: cannot read event file '/proc/self/mem': "
                           "Input/output error\n")
    assert [json.loads(line)["type"] for line in proc.stdout.splitlines()] == ["ready",
                                                                             "stopped"]


def test_record_command_refuses_a_closed_stdout_in_one_line(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [props(0)])
    proc = subprocess.run(
        [sys.executable, "-m", "gpuwatch", "record", "--root", str(tmp_path),
         "--source", f"file:{src}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)}, preexec_fn=lambda: os.close(1),
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "stdout is closed" in proc.stderr


def test_record_command_refuses_to_write_over_the_file_it_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--out`` is truncated when opened: naming the source file (here through a link)
    would destroy the recording before a line of it was read."""
    maps = [props(i) for i in range(3)]
    src = tmp_path / "in.jsonl"
    write_jsonl(src, maps)
    (tmp_path / "link.jsonl").symlink_to(src)
    args = _parse(["--root", str(tmp_path), "--source", f"file:{src}",
                   "--out", str(tmp_path / "link.jsonl")])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--source file itself" in err
    assert [json.loads(text) for text in src.read_text().splitlines()] == maps


def test_record_command_refuses_a_stdout_appending_to_the_file_it_reads(
    tmp_path: Path,
) -> None:
    """``gpuwatch record --source file:cap.jsonl >> cap.jsonl``: each line read was written
    back behind the reader and read again, so the file grew until the disk was full."""
    maps = [props(i) for i in range(12_000)]  # past one read chunk: the reader never catches up
    src = tmp_path / "in.jsonl"
    write_jsonl(src, maps)
    before = src.read_bytes()
    with open(src, "ab") as stdout:
        proc = subprocess.run(
            [sys.executable, "-m", "gpuwatch", "record", "--root", str(tmp_path),
             "--source", f"file:{src}"],
            stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=30,
            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "stdout is the --source file" in proc.stderr
    assert src.read_bytes() == before


def test_record_command_refuses_an_out_fifo_that_is_its_source(tmp_path: Path) -> None:
    """The same FIFO as source and ``--out``: the recorder read its own lines back forever
    (and, holding the FIFO open for writing, never saw the end of its input)."""
    fifo = tmp_path / "ev.fifo"
    os.mkfifo(fifo)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwatch", "record", "--root", str(tmp_path),
         "--source", f"file:{fifo}", "--out", str(fifo)],
        env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, err
    assert err.count("\n") == 1 and "--source file itself" in err


def test_record_command_waiting_for_an_out_fifo_reader_ends_cleanly_on_sigterm(
    tmp_path: Path,
) -> None:
    """``--out`` a FIFO nobody reads yet: the open waits for a reader. A SIGTERM then is
    the normal end of a recording as it is later (exit 0), not a kill by the signal."""
    source, out = tmp_path / "ev.fifo", tmp_path / "out.fifo"
    os.mkfifo(source)
    os.mkfifo(out)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwatch", "record", "--root", str(tmp_path),
         "--source", f"file:{source}", "--out", str(out)],
        env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE, text=True)
    writer = -1
    try:
        deadline = time.monotonic() + 30
        while writer < 0:  # ENXIO until the recorder has its source open; --out is next
            try:
                writer = os.open(source, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "recorder not up"
                time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if writer >= 0:
            os.close(writer)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert err == ""


def test_record_command_ends_cleanly_on_sigterm(tmp_path: Path) -> None:
    """A live recording (here: a FIFO whose writer stays connected) ends with exit 0."""
    fifo = tmp_path / "ev.fifo"
    os.mkfifo(fifo)
    out = tmp_path / "out.jsonl"
    script = textwrap.dedent(f"""
        import argparse, sys
        from gpuwatch.cli import record_cmd
        p = argparse.ArgumentParser()
        record_cmd.register(p.add_subparsers())
        a = p.parse_args(["record", "--source", "file:{fifo}", "--out", "{out}"])
        sys.exit(a.func(a))
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE)
    try:
        fd = -1
        deadline = time.monotonic() + 10
        while fd < 0:  # ENXIO until the recorder has the FIFO open; never block forever
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "recorder not up"
                time.sleep(0.05)
        with open(fd, "w", encoding="utf-8") as writer:
            writer.write(json.dumps(props(5)) + "\n")
            writer.flush()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not out.read_text(encoding="utf-8"):
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()] == [props(5)]


def test_record_command_whose_reader_stops_reading_still_ends_on_sigterm(
    tmp_path: Path,
) -> None:
    """``gpuwatch record | less`` with ``less`` paused: the recording pauses (reading its
    source waits for room), but SIGTERM ends it at once, exit 0. A write to the stalled
    stdout on the event loop held the signal until the reader read again (or forever)."""
    source = tmp_path / "ev.fifo"
    os.mkfifo(source)
    # A small hand-over buffer (1 MiB by default): the stall comes after a few KiB.
    code = ("import sys; from gpuwatch.cli import record_cmd; record_cmd._OUT_BUFFER = 4096; "
            "from gpuwatch.cli.main import main; sys.exit(main())")
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "record", "--root", str(tmp_path),
         "--source", f"file:{source}"],
        env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    sent = [0]
    line = (json.dumps(props(1)) + "\n").encode()

    def push() -> None:  # blocks once the recorder stops reading its source
        with contextlib.suppress(BrokenPipeError), open(source, "wb", buffering=0) as fifo:
            for _ in range(50_000):
                fifo.write(line)
                sent[0] += len(line)

    pusher = threading.Thread(target=push, daemon=True)
    pusher.start()
    try:
        deadline = time.monotonic() + 30
        last = -1
        while sent[0] != last or sent[0] < 150_000:  # past the pipe and the FIFO: stalled
            assert time.monotonic() < deadline and pusher.is_alive(), f"sent {sent[0]} bytes"
            last = sent[0]
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
        err = proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == 0, err
    assert "Traceback" not in err


def _read_offset(pid: int, path: Path) -> int | None:
    """Where process ``pid`` is in its open ``path`` (/proc/PID/fdinfo), None if not open."""
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in os.listdir(fd_dir):
        with contextlib.suppress(OSError):
            if os.readlink(fd_dir / fd) == str(path):
                info = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
                return int(info.split("pos:")[1].split()[0])
    return None


@pytest.mark.timeout(60)
def test_a_recording_stopped_by_sigterm_still_writes_what_it_has_read(tmp_path: Path) -> None:
    """Ctrl-C while the reader of the recording is behind: the lines the recorder has
    already taken from its source still reach the reader (within the stop's grace), instead
    of being dropped with the writer's queue."""
    maps = [props(i) for i in range(2000)]  # ~0.5 MiB: beyond the pipe, within the buffer
    source = tmp_path / "in.jsonl"
    write_jsonl(source, maps)
    out = tmp_path / "out.fifo"
    os.mkfifo(out)
    reader = os.open(out, os.O_RDONLY | os.O_NONBLOCK)  # there, and not reading yet
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwatch", "record", "--root", str(tmp_path),
         "--source", f"file:{source}", "--out", str(out)],
        env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE)
    got = b""
    try:
        deadline = time.monotonic() + 30
        while _read_offset(proc.pid, source) != source.stat().st_size:
            assert time.monotonic() < deadline and proc.poll() is None, "source not read"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # the stop is under way before the reader reads on (within 2 s)
        os.set_blocking(reader, True)
        while chunk := os.read(reader, 1 << 16):
            got += chunk
        proc.wait(timeout=20)
    finally:
        os.close(reader)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        err = proc.stderr.read().decode()
        proc.stderr.close()
    assert proc.returncode == 0, err
    assert [json.loads(line) for line in got.decode().splitlines()] == maps


def test_a_recording_saved_with_a_byte_order_mark_keeps_its_first_event(tmp_path: Path) -> None:
    """An editor that saves UTF-8 with a BOM (or such files concatenated with ``cat``):
    the mark is no part of a line, and no event is skipped for it."""
    maps = [props(i) for i in range(3)]
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_jsonl(first, maps[:2])
    write_jsonl(second, maps[2:])
    joined = tmp_path / "joined.jsonl"
    joined.write_bytes(b"\xef\xbb\xbf" + first.read_bytes() + b"\xef\xbb\xbf" + second.read_bytes())
    out = tmp_path / "out.jsonl"
    args = _parse(["--root", str(tmp_path), "--source", f"file:{joined}", "--out", str(out)])
    assert args.func(args) == 0
    assert [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()] == maps
