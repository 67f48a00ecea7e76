"""``--since-seq`` over a log with junk in it (a crash's NULs, a torn line, lines that are no
event, a region without a newline): the bisection that finds where to start gives what a
plain read of every line gives, and junk never makes it read through the junk."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from watch_helpers import CountingFile, count_log_reads

from gpuwatch.cli import events_cmd
from gpuwatch.watch import eventlog
from gpuwatch.watch.eventlog import read_chunks, read_events, read_records

TIME = "2026-12-02T17:20:41.123456Z"


def line(seq: int, pad: int = 0) -> bytes:
    event = {"seq": seq, "time": TIME, "type": "ready", **({"pad": "p" * pad} if pad else {})}
    return json.dumps(event, separators=(",", ":")).encode() + b"\n"


# What a log may hold besides events; none of it decodes as one, alone or run into the
# line after it (a torn line has no newline: the next bytes end it, and it is no event).
JUNK_KINDS: dict[str, Any] = {
    "nuls": st.integers(1, 3000).map(lambda n: b"\0" * n),
    "nuls-line": st.integers(1, 3000).map(lambda n: b"\0" * n + b"\n"),
    "no-newline": st.integers(1, 3000).map(lambda n: b"x" * n),
    "lines": st.lists(st.sampled_from([b"not json", b"{}", b"[1,2]", b'{"seq":"7"}',
                                       b'{"seq":0,"time":"t","type":"x"}', b"",
                                       b'{"seq":5,"type":7}', b"\xff\xfe"]),
                      min_size=1, max_size=200).map(lambda ls: b"\n".join(ls) + b"\n"),
    "torn": st.integers(1, 40).map(lambda n: line(999_999)[:n]),
    "binary": st.binary(min_size=1, max_size=2000),
}


@st.composite
def logs(draw: st.DrawFn) -> list[bytes]:
    """1 to 4 files, oldest first: runs of events (seqs growing, with jumps: damage or a
    gap) between junk regions, a file often ending in a junk tail of many windows (a
    crash's leftovers: what choosing the file to start in must not read through)."""
    seq = draw(st.integers(1, 50))
    files = []
    for _ in range(draw(st.integers(1, 4))):
        parts = []
        for _ in range(draw(st.integers(0, 8))):
            if draw(st.booleans()):
                for _ in range(draw(st.integers(1, 40))):
                    parts.append(line(seq, pad=draw(st.integers(0, 120))))
                    seq += draw(st.sampled_from([1, 1, 1, 1, 2, 17]))
            else:
                junk = draw(st.sampled_from(sorted(JUNK_KINDS)))
                parts.append(draw(JUNK_KINDS[junk]))
        if draw(st.booleans()):  # a junk tail: several kinds, up to tens of windows
            for _ in range(draw(st.integers(1, 4))):
                parts.append(draw(JUNK_KINDS[draw(st.sampled_from(sorted(JUNK_KINDS)))]))
        files.append(b"".join(parts))
    return files


def write_log(path: Path, files: list[bytes]) -> None:
    for index, data in enumerate(reversed(files)):  # PATH, PATH.1 … (newest first)
        Path(eventlog.rotated_path(path, index)).write_bytes(data)


def linear(files: list[bytes], since: int) -> list[str]:
    """Every whole line of every file in order that is an event with a seq above
    ``since``: the plain scan a bisection must agree with."""
    out: list[str] = []
    last = since
    for data in files:
        for raw in data.split(b"\n")[:-1]:  # what follows the last newline is torn
            decoded = eventlog._decode(raw)
            if decoded is not None and decoded[0]["seq"] > last:
                last = decoded[0]["seq"]
                out.append(decoded[1])
    return out


def all_seqs(files: list[bytes]) -> list[int]:
    return [json.loads(text)["seq"] for text in linear(files, 0)]


@pytest.mark.parametrize("window", [256, 1024, 32 * 1024])
@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(files=logs(), data=st.data())
def test_since_seq_finds_what_a_linear_scan_finds(
    tmp_path: Path, window: int, files: list[bytes], data: st.DataObject
) -> None:
    """For every ``since``: the same lines as a plain scan, from the one-shot reader, the
    chunked replay and the start offset alike (small windows make the bisection probe,
    gallop and bracket junk in logs of a few KiB)."""
    path = tmp_path / f"ev-{window}.jsonl"
    for old in tmp_path.glob(path.name + "*"):
        old.unlink()
    write_log(path, files)
    seqs = all_seqs(files)
    around = {s + d for s in seqs for d in (-1, 0, 1)} | {0, 1}
    # Near where a file's events begin and end: where choosing the file to start in decides.
    edges = {s + d for raw in files for s in all_seqs([raw])[:1] + all_seqs([raw])[-1:]
             for d in (-2, -1, 0, 1)} | {0}
    since = data.draw(st.sampled_from(sorted(edges)) | st.sampled_from(sorted(around))
                      | st.integers(0, (seqs or [9])[-1] + 2))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(eventlog, "_PROBE_WINDOW", window)
        expected = linear(files, since)
        assert [r.line for r in read_records(path, since_seq=since)] == expected
        chunks = b"".join(c.data for c in read_chunks(path, since_seq=since))
        assert chunks.decode().split("\n")[:-1] == expected  # not splitlines: "\r" ends none
        for raw in files:  # each file alone: where the reader starts
            f = CountingFile(_bytes_file(raw))
            offset = eventlog._offset_after_seq(f, since)
            assert offset == 0 or raw[offset - 1:offset] == b"\n"
            assert linear([raw[offset:]], since) == linear([raw], since)
            assert f.reads <= _probe_bound(len(raw), window)


def _bytes_file(raw: bytes) -> Any:
    import io

    return io.BytesIO(raw)


def _probe_bound(size: int, window: int) -> int:
    """Reads a search may make: a few probes a halving, a halving per window's worth."""
    steps = max(size // window, 1).bit_length() + 1
    return 1 + steps * 4 * steps


# ------------------------------------------------------------------ a huge junk region

HEAD, TAIL = range(1, 2001), range(2001, 4001)
JUNK = b"\0" * (24 << 20) + b"\n" + b"garbage that is no event\n" * (1 << 20)


@pytest.fixture(scope="module")
def junk_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2000 events, ~48 MiB of junk (NULs without a newline, then lines that are no
    event), 2000 events: a crash's leftovers in the middle of one file."""
    path = tmp_path_factory.mktemp("junk") / "ev.jsonl"
    with path.open("wb") as f:
        f.write(b"".join(line(s, pad=200) for s in HEAD))
        f.write(JUNK)
        f.write(b"".join(line(s, pad=200) for s in TAIL))
    return path


@pytest.mark.parametrize("since", [0, 1, 700, 1999, 2000, 2001, 3000, 3999, 4000, 5000])
def test_a_huge_junk_region_is_searched_with_bounded_reads(
    junk_log: Path, monkeypatch: pytest.MonkeyPatch, since: int
) -> None:
    """Finding where to start reads a few dozen 64 KiB windows, not the 48 MiB of junk
    (each bisection step used to decode forward through it: a replay of the last events
    read all of it). Reading on from there costs what is wanted, and the junk only when
    wanted events precede it."""
    opened = count_log_reads(monkeypatch)
    records = read_records(junk_log, since_seq=since)
    first = next(records, None)
    found = sum(f.read_bytes for f in opened)
    assert found < 4 << 20  # was ~48 MiB
    assert sum(f.reads for f in opened) < 100
    rest = [r.event["seq"] for r in records]
    got = ([first.event["seq"]] if first else []) + rest
    assert got == [s for s in (*HEAD, *TAIL) if s > since]
    if since >= HEAD[-1]:  # the junk lies before what is wanted: never read through
        assert sum(f.read_bytes for f in opened) < 6 << 20


def test_gpuwatch_events_since_seq_past_a_huge_junk_region(
    junk_log: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command resumes after the junk as cheaply, and prints exactly the events after
    N."""
    opened = count_log_reads(monkeypatch)
    assert events_cmd.main([str(junk_log), "--since-seq", "3990"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [json.loads(text)["seq"] for text in out] == list(range(3991, 4001))
    assert sum(f.read_bytes for f in opened) < 4 << 20


def test_a_region_without_newlines_is_bisected_past_not_read(tmp_path: Path) -> None:
    """One probe reads one bounded window, whatever the junk around it: NULs without a
    newline in the middle, an event line after them eaten (it is no line of its own)."""
    tail = b"".join(line(s) for s in range(300, 600))
    raw = b"".join(line(s) for s in range(1, 300)) + b"\0" * (16 << 20) + tail
    f = CountingFile(_bytes_file(raw))
    offset = eventlog._offset_after_seq(f, 400)
    assert linear([raw[offset:]], 400) == linear([raw], 400)
    assert offset > len(raw) - len(tail)  # past the NULs
    assert f.largest <= 2 * eventlog._PROBE_WINDOW + 1
    assert f.read_bytes < 2 << 20
    assert [e["seq"] for e in read_events_of(tmp_path, raw, 298)] == [299, *range(301, 600)]


def read_events_of(tmp_path: Path, raw: bytes, since: int) -> list[dict[str, Any]]:
    path = tmp_path / "ev.jsonl"
    path.write_bytes(raw)
    return list(read_events(path, since_seq=since))


# ------------------------------------------------------- choosing the file to start in


def test_every_since_across_rotated_files_with_junk_tails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each ``since`` from before the first event to past the last, over four files that
    end in junk (NULs, a torn line, lines that are no event): what a linear scan prints,
    also for ``since`` just below and at a file's edge (where the file to start in is
    chosen)."""
    monkeypatch.setattr(eventlog, "_PROBE_WINDOW", 256)
    tails = [b"\0" * 5000, line(99)[:30], b"not json\n" * 400, b"\0" * 3000 + b"\n"]
    files = [b"".join(line(s, pad=40) for s in range(1 + 30 * i, 31 + 30 * i)) + tails[i]
             for i in range(4)]
    path = tmp_path / "ev.jsonl"
    write_log(path, files)
    for since in range(0, 124):
        assert [r.line for r in read_records(path, since_seq=since)] == linear(files, since)


def test_rotated_files_with_huge_junk_tails_are_passed_over_with_bounded_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PATH.3 … PATH.1 each end in 16 MiB of a crash's NULs: resuming in PATH reads a few
    windows a file, not the 48 MiB of tails (each file's last seq was found by reading its
    tail backwards: 16 MiB a file)."""
    path = tmp_path / "ev.jsonl"
    files = [b"".join(line(s, pad=100) for s in range(1 + 500 * i, 501 + 500 * i))
             + (b"\0" * (16 << 20) if i < 3 else b"") for i in range(4)]
    write_log(path, files)
    for since in (1600, 1999):
        opened = count_log_reads(monkeypatch)
        got = [r.event["seq"] for r in read_records(path, since_seq=since)]
        assert got == list(range(since + 1, 2001))
        assert sum(f.read_bytes for f in opened) < 2 << 20  # was ~48 MiB
        monkeypatch.undo()


def test_seqs_that_go_back_at_a_file_start_keep_the_earlier_files_events(
    tmp_path: Path,
) -> None:
    """A writer that gave up on a junk tail numbers after what it found before it, so a
    file may start below where the one before it ends: a linear read prints the earlier
    file's events after N, and so does the replay (it does not start in the later file
    because that one starts at or before N + 1)."""
    files = [b"".join(line(s) for s in range(1, 1001)), b"".join(line(s) for s in range(301, 401))]
    path = tmp_path / "ev.jsonl"
    write_log(path, files)
    for since in (500, 300, 999):
        expected = linear(files, since)
        assert expected == [line(s).decode().rstrip("\n") for s in range(since + 1, 1001)]
        assert [r.line for r in read_records(path, since_seq=since)] == expected
