"""A damaged line inside one log file, on every replay path.

Logs get damaged (a crash, a disk error): a line in the middle of a file can be garbled or
missing. Such a line is a hole in the seqs the log holds, exactly as a rotated file missing
from the middle is, so a replay (socket ``subscribe`` with ``since_seq``, in-process
``subscribe(since_seq=…)``) stops there with the lagged notice naming the seq, and resuming
after it says ``complete: false``. And the socket replay, which forwards stored lines
without decoding them when it can, never sends a damaged line as if it were an event:
every line it sends is one the strict JSON decoder accepts, whichever path it took.
"""

from __future__ import annotations

import functools
import json
import socket
import tempfile
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import anyio
import pytest
from daemon_helpers import Daemon, Lines, connect
from hypothesis import given, settings
from hypothesis import strategies as st

import gpuwatch
from gpuwatch.core import strictjson
from gpuwatch.errors import SubscriberLagged
from gpuwatch.host import open_host
from gpuwatch.service import protocol as P
from gpuwatch.service.testing import short_socket_dir
from gpuwatch.sources.memory import MemorySource
from gpuwatch.testing import SysRoot
from gpuwatch.testing.machines import FLEX_PF, intel_flex_sriov_host
from gpuwatch.watch import eventlog
from gpuwatch.watch.eventlog import _decode, _plain_heads, read_chunks, read_records

NV = "0000:01:00.0"
GAP = 17  # lines between two damaged ones: each lands inside a 4 KiB replay chunk
OLD = b'"old":"nvidia"'

#: How each damaged line is stored: a function of its seq, or None for a line lost whole.
DAMAGE: dict[str, bytes | None] = {
    "nan": OLD.replace(b'"nvidia"', b"NaN"),
    "infinity": OLD.replace(b'"nvidia"', b"Infinity"),
    "minus-infinity": OLD.replace(b'"nvidia"', b"-Infinity"),
    "overflow": OLD.replace(b'"nvidia"', b"1e999"),
    "bad-utf8": OLD.replace(b"nvidia", b"nv\xff\xfeidia"),
    "lone-surrogate": OLD.replace(b"nvidia", b"nv\\ud800idia"),
    "lost-quote": OLD.replace(b'"old"', b'"old'),
    "seq-out-of-step": b"",  # the line of another seq (written again, or garbled digits)
    "nul-bytes": OLD.replace(b"nvidia", b"nv\x00idia"),
    "missing": None,
    # Garbled digits that run on: a seq no float holds, longer than `int` takes from text.
    "seq-too-long": b"9" * 4400,
}
#: Lines that look unusual but are events: replayed as stored, with no hole.
BENIGN: dict[str, bytes] = {
    "non-ascii": OLD.replace(b"nvidia", "nvïdia".encode()),
    "control-escape": OLD.replace(b"nvidia", b"nv\\u0007idia"),
    "surrogate-pair": OLD.replace(b"nvidia", b"nv\\ud83d\\ude00idia"),
    "string-nan": OLD.replace(b"nvidia", b"NaN Infinity"),
}


def good_line(seq: int, old: bytes = OLD) -> bytes:
    return (b'{"seq":%d,"time":"2026-01-01T00:00:00.000000Z","type":"driver-changed",'
            b'"addr":"%s",%s,"new":"vfio-pci"}\n' % (seq, NV.encode(), old))


def damaged_line(seq: int, kind: str) -> bytes:
    damage = DAMAGE[kind]
    if damage is None:
        return b""
    if kind == "nul-bytes":  # a zeroed block: nothing of the line left but its length
        return b"\x00" * (len(good_line(seq)) - 1) + b"\n"
    if kind == "seq-out-of-step":
        return good_line(seq - 1)
    if kind == "seq-too-long":
        return good_line(seq).replace(b'"seq":%d' % seq, b'"seq":' + damage, 1)
    return good_line(seq, damage)


def write_damaged_log(path: Path) -> tuple[dict[int, str], dict[int, bytes], int]:
    """One log file with a damaged line every `GAP` lines and the benign oddities between:
    ({damaged seq: kind}, {seq: stored line} of the events, last seq)."""
    damaged: dict[int, str] = {}
    stored: dict[int, bytes] = {}
    out = []
    seq = 0
    kinds = list(DAMAGE)
    benign = list(BENIGN.values())
    for index in range(len(kinds) + 1):
        for offset in range(1, GAP):
            seq += 1
            old = benign[(index + offset) % len(benign)] if offset % 9 == 0 else OLD
            stored[seq] = good_line(seq, old)
            out.append(stored[seq])
        if index < len(kinds):
            seq += 1
            damaged[seq] = kinds[index]
            out.append(damaged_line(seq, kinds[index]))
    path.write_bytes(b"".join(out))
    return damaged, stored, seq


def test_the_damaged_lines_are_damaged_and_the_benign_ones_events() -> None:
    """The premise: the strict decoder refuses each damaged line and takes each benign one."""
    for kind, damage in DAMAGE.items():
        if damage:
            with pytest.raises(ValueError):
                strictjson.loads(damaged_line(7, kind).rstrip(b"\n"))
    for old in BENIGN.values():
        assert strictjson.loads(good_line(7, old))["seq"] == 7


def test_read_chunks_never_hands_out_a_damaged_line_nor_spans_a_hole(tmp_path: Path) -> None:
    """Every chunk of a replay holds exactly the lines of its seq range, each one the strict
    decoder accepts, stored bytes unchanged; a damaged or missing line ends a chunk, so the
    next one starts after a jump (what the server reads as a hole). Was: the chunk that held
    it was forwarded whole (a NaN or a garbled line went out as stored) or covered the hole
    (``first``…``last`` spanning a seq it did not hold)."""
    log = tmp_path / "events.jsonl"
    damaged, stored, _ = write_damaged_log(log)
    for wants in (None, lambda etype, addr: True):
        sent: list[int] = []
        for chunk in read_chunks(log, since_seq=0, wants=wants):
            lines = chunk.data.splitlines(keepends=True)
            seqs = [strictjson.loads(line)["seq"] for line in lines]
            assert seqs == list(range(chunk.first, chunk.last + 1)), (chunk.first, chunk.last)
            assert all(line == stored[seq] for seq, line in zip(seqs, lines, strict=True))
            sent += seqs
        assert sent == sorted(stored)
        assert not set(sent) & set(damaged)


def test_read_records_takes_no_damaged_line_for_an_event(tmp_path: Path) -> None:
    """What the in-process replay and ``gpuwatch events`` read: the damaged lines are not
    events (was: ``NaN``, ``1e999`` and a lone surrogate passed), nor is a line with a key
    twice over, which the strict decoder refuses too."""
    log = tmp_path / "events.jsonl"
    _, stored, last = write_damaged_log(log)
    with log.open("ab") as f:
        f.write(good_line(last + 1, OLD + b',"old":"nouveau"') + good_line(last + 2))
    records = list(read_records(log))
    assert [r.event["seq"] for r in records] == [*sorted(stored), last + 2]
    assert all(r.line.encode() + b"\n" == stored[r.event["seq"]] for r in records[:-1])


@pytest.fixture
def sockdir() -> Iterator[str]:
    with short_socket_dir() as path:
        yield path


@pytest.mark.timeout(120)
@pytest.mark.parametrize("filtered", [False, True], ids=["as-stored", "filtered"])
def test_a_socket_replay_stops_at_each_damaged_line_and_sends_none(
    host: SysRoot, tmp_path: Path, sockdir: str, filtered: bool
) -> None:
    """A real daemon replays a log with a damaged line every few dozen: each replay sends
    the events before the damaged line as stored, then the `lagged` line naming its seq,
    and resuming from there is ``complete: false`` and runs to the next one. No line sent
    is refused by the strict decoder. Was: a ``NaN``/``Infinity``/invalid UTF-8/lone
    surrogate line went out verbatim on the fast path, and a garbled or missing line inside
    one chunk was skipped silently under ``complete: true``."""
    damaged, stored, last = write_damaged_log(tmp_path / "events.jsonl")
    params: dict[str, Any] = {"types": ["driver-changed"]} if filtered else {}
    d = Daemon(host.root, tmp_path, f"{sockdir}/gw.sock", "--log-max-bytes", str(64 << 20))
    with d:
        since = 0
        for hole, kind in sorted(damaged.items()):
            with connect(d.sock) as s:
                lines = Lines(s)
                reply = lines.request("subscribe", {**params, "since_seq": since})
                assert reply["result"]["complete"] is (since == 0), (kind, reply)
                start = since + 1 if since == 0 else since + 2
                for seq in range(start, hole):
                    raw = lines.raw()
                    assert raw == stored[seq], (kind, seq, raw)
                lagged = json.loads(lines.raw())
                assert lagged == {"type": "lagged", "missed": 1, "first_missed_seq": hole,
                                  "resume_since_seq": hole - 1, "outbox_limit": 4 << 20}, kind
                assert lines.eof(), kind
            since = hole - 1
        with connect(d.sock) as s:  # after the last one: to the end, then `ready`
            lines = Lines(s)
            reply = lines.request("subscribe", {**params, "since_seq": since})
            assert reply["result"] == {"seq": last + 1, "complete": False}, reply
            for seq in range(since + 2, last + 1):
                assert lines.raw() == stored[seq], seq
            if not filtered:
                ready = P.loads(lines.raw())
                assert (ready["seq"], ready["type"]) == (last + 1, "ready")
            s.shutdown(socket.SHUT_WR)
    assert d.proc is not None and d.proc.returncode == 0, d.stderr
    assert "Traceback" not in d.stderr, d.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("filtered", [False, True], ids=["all", "filtered"])
async def test_an_in_process_replay_stops_at_each_damaged_line(
    host: SysRoot, tmp_path: Path, filtered: bool
) -> None:
    """The same log replayed in process: `SubscriberLagged` at each damaged line, naming its
    seq, and never an event made of one. Was: a line that ``json`` decodes but the event
    model refuses (``NaN``, ``1e999``, a lone surrogate) was passed over while the seqs
    went on, so the subscriber never learnt that seq was missing."""
    log = tmp_path / "events.jsonl"
    damaged, _, last = write_damaged_log(log)
    types = {"driver-changed"} if filtered else None
    async with open_host(host.root, source=MemorySource(), log=str(log), reconcile_interval=0,
                         cdi_poll_interval=0) as gpu_host:
        since = 0
        for hole, kind in sorted(damaged.items()):
            got: list[int] = []
            async with gpu_host.subscribe(types=types, since_seq=since) as sub:
                assert sub.complete is (since == 0), kind
                with anyio.fail_after(10), pytest.raises(SubscriberLagged) as caught:
                    while True:
                        got.append((await sub.receive()).seq)
            start = since + 1 if since == 0 else since + 2
            assert got == list(range(start, hole)), kind
            assert (caught.value.first_missed_seq, caught.value.missed) == (hole, 1), kind
            since = hole - 1
        async with gpu_host.subscribe(types=types, since_seq=since) as sub:
            assert not sub.complete
            got = []
            with anyio.fail_after(10):
                while len(got) < last - since - 1:
                    got.append((await sub.receive()).seq)
        assert got == list(range(since + 2, last + 1))


def _has_duplicate_key(line: bytes) -> bool:
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        if len({k for k, _ in items}) != len(items):
            raise KeyError("duplicate")
        return dict(items)
    try:
        json.loads(line, object_pairs_hook=pairs)
    except KeyError:
        return True
    except ValueError:
        return False
    return False


SWITCH = (b'{"seq":7,"time":"2026-01-01T00:00:00.000000Z","type":"switch-completed",'
          b'"members":[{"addr":"0000:01:00.0","old":"nvidia","new":"vfio-pci"}],'
          b'"duration_ms":12.5,"ok":true,"notes":null,"n":[1,-2,3.25e-7,[{}],{"a":[]}]}\n')


@functools.cache
def real_log() -> bytes:
    """What the writer writes while an SR-IOV GPU's PF goes to vfio-pci, back to i915 and
    off its driver: among it the deepest lines a real log holds, `probe-changed`
    ``detect-vfio`` (its GPUs, their group members, the PF's VFs), made by a real watcher."""

    async def run(root: Path) -> bytes:
        host = intel_flex_sriov_host(root / "host", vfs=2)
        log = root / "events.jsonl"
        source = MemorySource()
        async with gpuwatch.open_watcher(host.root, source, log=str(log),
                                         reconcile_interval=0, cdi_poll_interval=0) as w:
            for driver in ("vfio-pci", "i915", ""):
                if driver:
                    host.bind(FLEX_PF, driver)
                    source.push(host.uevent_props("bind", FLEX_PF, DRIVER=driver))
                else:
                    host.unbind(FLEX_PF)
                    source.push(host.uevent_props("unbind", FLEX_PF))
                await w.wait_for(lambda e: getattr(e, "type", "") == "driver-changed",
                                 timeout=10)
        return log.read_bytes()

    with tempfile.TemporaryDirectory() as where:
        return anyio.run(run, Path(where))


def depth(line: bytes) -> int:
    return strictjson.json_depth(line.decode())


def deepest_line() -> bytes:
    """The real log's deepest line (see `real_log`), its seq made 7."""
    deep = max(real_log().splitlines(keepends=True), key=depth)
    return b'{"seq":7,' + deep.split(b",", 1)[1]


@settings(max_examples=3000, deadline=None)
@given(st.sampled_from([lambda: good_line(7), lambda: SWITCH, deepest_line]).map(lambda f: f()),
       st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 3), st.one_of(
           st.binary(min_size=1, max_size=3),
           st.text(alphabet='[]{},:"0123456789eE+-. nultrfsa', min_size=1,
                   max_size=4).map(str.encode))), min_size=1, max_size=3))
def test_a_line_the_fast_path_vouches_for_is_one_the_strict_decoder_takes(
        line: bytes, edits: list[tuple[int, int, bytes]]) -> None:
    """The replay's fast path sends a line as stored when `_plain_heads` gives its seq: that
    must never be a line `_decode` (strict JSON, a whole seq, a string type) refuses,
    whatever bytes a damage flips, drops or inserts. (A key twice over is the one thing
    the pattern cannot see: documented, and left out here.)"""
    body = bytearray(line[:-1])
    for at, drop, insert in edits:
        at = min(at, len(body))
        body[at:at + drop] = insert.replace(b"\n", b"")
    damaged = bytes(body) + b"\n"
    heads = _plain_heads(good_line(6) + damaged + good_line(8))
    if heads is None:
        return  # the whole run is decoded line by line
    assert len(heads) == 3
    head = heads[1]
    if head and not _has_duplicate_key(damaged):
        decoded = _decode(damaged[:-1])
        assert decoded is not None, damaged
        assert decoded[0]["seq"] == int(head), damaged
        strictjson.loads(damaged)


def test_the_fast_path_takes_the_lines_the_writer_writes() -> None:
    """What the writer writes (nested lists and objects, floats, true/null) is vouched
    for by the pattern: the fast path is the path real logs take."""
    assert _plain_heads(good_line(7) + SWITCH + good_line(8)) == [b"7", b"7", b"8"]


def test_a_real_log_replays_as_stored_without_a_line_decoded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real log, its `detect-vfio` lines nested seven deep (a GPU, its group members,
    the PF's VFs) included, goes out as stored through the fast path: the socket replay
    decodes none of its lines (each decode is ~3x the bytes' cost of vouching)."""
    data = real_log()
    lines = data.splitlines(keepends=True)
    deep = [ln for ln in lines if b'"action":"detect-vfio"' in ln]
    assert deep and all(b'"group_members"' in ln for ln in deep)
    assert max(map(depth, deep)) >= 7  # deeper than `_PLAIN_LINE` reaches
    assert _plain_heads(data) == [str(json.loads(ln)["seq"]).encode() for ln in lines]
    decoded: list[bytes] = []

    def counted(raw: bytes) -> Any:
        decoded.append(raw)
        return _decode(raw)

    monkeypatch.setattr(eventlog, "_decode", counted)
    # Forty rounds of it, seqs running on, so that the replay reads many 4 KiB chunks.
    stored = b"".join(b'{"seq":%d,%s' % (k * len(lines) + n, ln.split(b",", 1)[1])
                      for k in range(40) for n, ln in enumerate(lines, 1))
    path = tmp_path / "events.jsonl"
    path.write_bytes(stored)
    chunks = list(read_chunks(path))  # from the start: no search for a seq (which decodes)
    assert len(chunks) > 10
    assert b"".join(c.data for c in chunks) == stored
    assert (chunks[0].first, chunks[-1].last) == (1, 40 * len(lines))
    assert decoded == []


@pytest.mark.parametrize("digits", [400, 4400])
@pytest.mark.parametrize("before", range(0, 40, 3))
def test_a_seq_too_long_for_a_float_is_a_hole_wherever_it_falls_in_a_read(
        tmp_path: Path, digits: int, before: int) -> None:
    """A seq of hundreds or thousands of digits (garbled digits that run on) is no seq the
    strict decoder takes: the line is a hole, wherever it falls among the replay's 4 KiB
    reads (``before`` lines ahead of it move it). Was: the fast path took the digits for
    its seq, and past 4,300 of them ``int`` raised out of the replay (the daemon's task
    with it) instead of a hole."""
    long_seq = good_line(before + 1).replace(b'"seq":%d' % (before + 1),
                                             b'"seq":' + b"9" * digits, 1)
    assert _decode(long_seq[:-1]) is None
    assert _plain_heads(long_seq) == [b""]
    log = tmp_path / "events.jsonl"
    log.write_bytes(b"".join(good_line(seq) for seq in range(1, before + 1)) + long_seq
                    + b"".join(good_line(seq) for seq in range(before + 2, before + 40)))
    chunks = list(read_chunks(log, since_seq=0))
    sent = b"".join(chunk.data for chunk in chunks)
    assert long_seq not in sent
    assert [strictjson.loads(line)["seq"] for line in sent.splitlines()] == [
        *range(1, before + 1), *range(before + 2, before + 40)]
    if before:  # the hole shows as a jump between two chunks
        assert any(b.first == before + 2 and a.last == before for a, b in pairwise(chunks))


@pytest.mark.parametrize("number", [b"1e999", b"-1E+400", b"1" * 400 + b".5", b"NaN"])
def test_a_deep_line_with_a_number_no_float_holds_is_left_to_the_strict_decoder(
        number: bytes) -> None:
    """A deep line is vouched for by pydantic-core's parser, which reads ``1e999`` as
    infinity: the bytes of such a number keep the line from being vouched for, and the
    strict decoder refuses it."""
    line = deepest_line()
    damaged = line.replace(b'"iommu_group":', b'"iommu_group":' + number + b',"x":', 1)
    assert damaged != line
    assert _plain_heads(line) == [b"7"]
    assert _plain_heads(damaged) == [b""]
    assert _decode(damaged[:-1]) is None


@pytest.mark.parametrize(("levels", "opener", "closer"), [
    *((d, b"[", b"]") for d in (31, 32, 33, 34)),
    *((d, b'{"a":', b"}") for d in (31, 32, 33, 34)),
    *((d, b'[{"a":', b"}]") for d in (31, 33)),  # two levels a step
])
def test_a_deep_line_is_vouched_for_exactly_as_deep_as_the_strict_decoder_goes(
        levels: int, opener: bytes, closer: bytes) -> None:
    """Nesting up to `strictjson`'s limit is vouched for, one level more is left to the
    strict decoder, which refuses it: arrays, objects, and the two taking turns (one pass
    of taking away the innermost pairs must take one level, not an array and then the
    object around it)."""
    steps = (levels - 1) // (2 if opener == b'[{"a":' else 1)
    line = (b'{"seq":5,"time":"t","type":"x","v":' + opener * steps + b"1" + closer * steps
            + b"}")
    assert_vouched_as_deep_as_strict(line, levels)


@pytest.mark.parametrize("levels", [31, 32, 33])
@pytest.mark.parametrize("text", ["]]]]][[[[[", "[[", "}{", "a[b]c"])
def test_brackets_inside_strings_do_not_count_as_nesting(levels: int, text: str) -> None:
    """A string's brackets are no nesting: wherever they sit, a line is vouched for exactly
    when the strict decoder takes it (they could otherwise make a line look shallower)."""
    steps = levels - 3  # the line's own object, and the list and object around the text
    line = (b'{"seq":5,"time":"t","type":"x","v":' + b'{"a":' * steps
            + b'["%s",{"b":"%s"}]' % (text.encode(), text.encode()) + b"}" * steps + b"}")
    assert_vouched_as_deep_as_strict(line, levels)


def assert_vouched_as_deep_as_strict(line: bytes, levels: int) -> None:
    """``line`` (seq 5) nests ``levels`` deep; the strict decoder takes it up to its limit,
    and the replay's fast path vouches for it exactly when the strict decoder takes it."""
    assert depth(line) == levels
    strict = _decode(line) is not None
    assert strict == (levels <= strictjson.MAX_DEPTH)
    assert _plain_heads(line + b"\n") == ([b"5"] if strict else [b""])
