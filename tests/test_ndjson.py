"""The one NDJSON framer: any chunking of any stream gives the lines a whole-stream split
gives, an over-long line is reported in its place and never held, and a last line without a
newline comes out at the end."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwatch.core.ndjson import TOO_LONG, LineFramer


def expected(stream: bytes, cap: int) -> list[bytes]:
    """The reference: split the whole stream at once."""
    lines = stream.split(b"\n")
    last = lines.pop()
    if last:
        lines.append(last)
    return [TOO_LONG if len(line) > cap else line for line in lines]


def framed(chunks: list[bytes], cap: int) -> tuple[list[bytes], int]:
    """(lines out, the most bytes ever held between calls)."""
    framer = LineFramer(cap)
    out: list[bytes] = []
    most = 0
    for chunk in chunks:
        out += framer.feed(chunk)
        most = max(most, framer.pending)
    out += framer.finish()
    return out, most


def chunked(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(stream)) for c in cuts})
    pieces, at = [], 0
    for p in points:
        pieces.append(stream[at:p])
        at = p
    pieces.append(stream[at:])
    return pieces


line = st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"x"))


@settings(max_examples=400, deadline=None)
@given(lines=st.lists(line, max_size=12), newline_at_end=st.booleans(),
       cuts=st.lists(st.integers(min_value=0, max_value=600), max_size=12),
       cap=st.integers(min_value=1, max_value=50))
def test_any_chunking_gives_the_whole_stream_split(
    lines: list[bytes], newline_at_end: bool, cuts: list[int], cap: int
) -> None:
    stream = b"\n".join(lines) + (b"\n" if newline_at_end and lines else b"")
    out, most = framed(chunked(stream, cuts), cap)
    assert out == expected(stream, cap)
    assert most <= cap  # an unfinished line is never held beyond the cap


def test_over_long_line_is_reported_before_its_newline_and_then_skipped() -> None:
    framer = LineFramer(8)
    assert framer.feed(b'{"a":1}\n{"b":') == [b'{"a":1}']
    assert framer.pending == 5
    # Passing the cap reports the line at once; its bytes are not kept.
    assert framer.feed(b"123456") == [TOO_LONG]
    assert framer.pending == 0
    assert framer.skipping
    assert framer.feed(b"x" * 1000) == []
    assert framer.pending == 0
    # The rest of the long line up to its newline is dropped, what follows is read.
    assert framer.feed(b'789}\n{"c":3}\n') == [b'{"c":3}']
    assert not framer.skipping
    assert framer.finish() == []


def test_complete_over_long_line_inside_one_chunk_keeps_its_neighbours() -> None:
    framer = LineFramer(4)
    assert framer.feed(b"ab\n" + b"y" * 9 + b"\ncd\n") == [b"ab", TOO_LONG, b"cd"]
    assert framer.feed(b"12345") == [TOO_LONG]  # unfinished and already too long
    assert framer.finish() == []  # an over-long last line is not handed out again


def test_exactly_the_cap_is_allowed() -> None:
    framer = LineFramer(4)
    assert framer.feed(b"abcd\nab") == [b"abcd"]
    assert framer.feed(b"cd") == []
    assert framer.feed(b"\n") == [b"abcd"]


def test_final_partial_line_and_reset() -> None:
    framer = LineFramer(100)
    assert framer.feed(b'{"x":1}\n{"y"') == [b'{"x":1}']
    assert framer.feed(b":2}") == []
    assert framer.finish() == [b'{"y":2}']
    assert framer.finish() == []
    framer.feed(b"torn")
    framer.reset()
    assert framer.pending == 0
    assert framer.feed(b"new\n") == [b"new"]


def test_marker_is_no_line() -> None:
    """A line never holds a newline, so the marker is told apart from every real line."""
    assert b"\n" in TOO_LONG
    with pytest.raises(ValueError, match="positive"):
        LineFramer(0)


def test_many_small_chunks_of_one_long_line() -> None:
    """A big reply read 64 KiB at a time comes out whole (and in linear time: no re-join
    of what is held on every chunk, which would take minutes here)."""
    piece = b"z" * (1 << 16)
    framer = LineFramer(64 << 20)
    for _ in range(512):
        assert framer.feed(piece) == []
    assert framer.pending == 512 << 16
    (whole,) = framer.feed(b"\n")
    assert len(whole) == 512 << 16


def test_a_line_dripped_a_byte_at_a_time_costs_its_bytes_not_an_object_each() -> None:
    """A peer that sends its partial line a byte or two per read (each read one ``feed``)
    holds the daemon to about the bytes it sent: kept as a list of the pieces, a 60 KB line
    was megabytes of objects, up to ~80 times the request limit the daemon promises to hold
    per connection. (Each piece its own object, as each read is; made before tracing.)"""
    framer = LineFramer(64 << 10)
    drip = [bytes(bytearray(b"zz")) for _ in range(30_000)]
    tracemalloc.start()
    try:
        for byte in drip:
            framer.feed(byte)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert framer.pending == 60_000
    assert held < 2 * 60_000, held
    assert framer.feed(b"z\n") == [b"z" * 60_001]
    assert framer.pending == 0


def test_importing_it_loads_nothing_heavy() -> None:
    """The fast CLI frames its reply with it before anything heavy is imported."""
    code = ("import sys; import gpuwatch.core.ndjson; "
            "print(sorted(m for m in ('pydantic', 'yaml', 'anyio', 'pyudev', 'json') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"
