"""Each fast path that reads someone else's bytes against the strict path it stands in for.

A fast path (a regex, pydantic-core's parser, a string formatted by hand) is only safe while
what it accepts is a part of what the strict path accepts, decoded to the same value, and
while it raises nothing the strict path would not. Generated lines, valid ones and the same
lines mutated (cut short, a number out of range, nesting past the bound, a key twice over,
escapes of NUL and of a lone surrogate, bytes that are not UTF-8, NUL, CR, long strings,
whitespace, keys moved or added), go through both:

- the event log's replay (`_plain_heads` vouching for stored lines, and the raw chunks a
  socket replay sends) against `_decode` and `read_records` (`strictjson`);
- a recording's line (pydantic-core's parser for an object of strings) against
  `parse_jsonl_line`;
- ``event_json`` of a ``driver-changed`` (formatted directly) against pydantic's line;
- a netlink message's subsystem (`subsystem_of`, read without parsing) against the
  message `parse_kernel_uevent` builds.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gpuwatch.core import strictjson
from gpuwatch.core.events import (
    DriverChanged,
    driver_changed,
    event_json,
    parse_event,
    scrub_surrogates,
    stamp,
)
from gpuwatch.core.uevent import parse_kernel_uevent, subsystem_of
from gpuwatch.sources.jsonl import MalformedLine, _LineSplitter, parse_jsonl_line
from gpuwatch.watch.eventlog import _decode, _plain_heads, read_chunks, read_records

pytestmark = pytest.mark.timeout(120)

#: Modest sizes: every test here stays well under 20 s on a shared core.
FAST = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
SLOW = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# --------------------------------------------------------------------------- generated lines

#: Strings that matter to a JSON reader: escapes, quotes, brackets, NUL, a lone surrogate,
#: non-ASCII, CR, and nothing at all.
odd_text = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", "0000:01:00.0", 'a"b', "c\\d", "[{", "}]", "\x00", "\r", "\x7f",
                     "\ud800", "\udfff", "ünï", "\u2028", "e", "1e999", ":", '":"', " :"]),
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=8),
)
#: Numbers at the edges of what a double holds and of what the pattern reads.
odd_number = st.one_of(
    st.integers(-(10**20), 10**20),
    st.sampled_from([0, -0, 10**199, 10**200, 10**308, 10**309, -(10**309), 2**64]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e-320, 1e308, -1.5e300, 0.1]),
)
json_value = st.recursive(
    st.one_of(st.none(), st.booleans(), odd_number, odd_text),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(odd_text, inner, max_size=3)),
    max_leaves=12,
)
#: Types a real log holds, and a few it does not.
type_st = st.sampled_from(["driver-changed", "probe-changed", "node-added", "log-gap", "x", ""])


@st.composite
def event_line(draw: st.DrawFn, seq: int | None = None) -> bytes:
    """One line as the writer writes it (compact, ``seq``/``time``/``type`` first), or in
    another spelling: ASCII-escaped, spaced, keys moved."""
    obj: dict[str, Any] = {
        "seq": draw(st.integers(1, 10**6)) if seq is None else seq,
        "time": draw(st.sampled_from(["2026-01-01T00:00:00.000001Z", "t"]) | odd_text),
        "type": draw(type_st),
    }
    for key, value in draw(st.dictionaries(odd_text, json_value, max_size=4)).items():
        if key not in obj:
            obj[key] = value
    if draw(st.booleans()):
        items = list(obj.items())
        draw(st.randoms()).shuffle(items)
        obj = dict(items)
    separators = draw(st.sampled_from([(",", ":"), (", ", ": "), (",", " :")]))
    text = json.dumps(obj, separators=separators, ensure_ascii=draw(st.booleans()))
    return text.encode("utf-8", "surrogatepass")


#: Bytes a mutation puts somewhere in a line.
NASTY = [b"\x00", b"\r", b"\t", b" ", b"\xff", b"\xed\xa0\x80", b"\\u0000", b"\\ud800", b"\\",
         b'"', b"{", b"}", b"[", b"]", b",", b":", b"1e999", b"-0", b"01", b"NaN", b"Infinity",
         b"9" * 320, b"9" * 5000, b"[" * 40 + b"]" * 40, b"\xef\xbb\xbf", b"x" * 5000]


#: A JSON number in a line (or digits in a string: the mutation then damages the string).
_NUMBER = re.compile(rb"-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
#: Spellings at the edges: out of range, not JSON, or JSON the pattern must bound.
ODD_NUMBERS = [b"1e999", b"1E+400", b"1e0400", b"-1e309", b"1e-999", b"1e99", b"-0", b"01",
               b"1.", b".5", b"+1", b"0x10", b"9" * 199 + b"e99", b"9" * 200 + b"e99",
               b"9" * 199 + b".9e99", b"9" * 250 + b"e99", b"9" * 300 + b"e9",
               b"9" * 310, b"9" * 4400, b"1" + b"0" * 308 + b".5",
               b"2" + b"0" * 308, b"NaN", b"-Infinity", b"1e", b"1e+"]


@st.composite
def mutated(draw: st.DrawFn, line: bytes) -> bytes:
    """``line`` damaged the ways a disk, a crash or a hostile writer damages one."""
    how = draw(st.sampled_from(["keep", "cut", "insert", "replace", "dup-key", "deep",
                                "space", "seq", "extra", "number", "nested-number"]))
    at = draw(st.integers(0, len(line)))
    if how == "cut":
        return line[:at]
    if how == "insert":
        return line[:at] + draw(st.sampled_from(NASTY)) + line[at:]
    if how == "replace":
        return line[:at] + draw(st.sampled_from(NASTY)) + line[at + 1:]
    if how == "dup-key":  # a key of the line once more, last (a strict reader refuses it)
        key = draw(st.sampled_from([b'"seq"', b'"type"', b'"time"', b'"a"']))
        return line[:-1] + b"," + key + b":" + draw(st.sampled_from([b"2", b'"y"'])) + b"}"
    if how == "deep":
        depth = draw(st.integers(2, 80))
        return line[:-1] + b',"d":' + b"[" * depth + b"]" * depth + b"}"
    if how == "space":
        return draw(st.sampled_from([b" ", b"\t", b"\r", b""])) + line + draw(
            st.sampled_from([b" ", b"\t", b"\r", b"\x00", b""]))
    if how == "seq":
        seq = draw(st.sampled_from([b"0", b"-1", b"01", b"1.0", b"1e2", b"-0", b"true",
                                    b'"1"', b"9" * 199, b"9" * 200, b"9" * 310, b"9" * 4400]))
        return b'{"seq":' + seq + b',"time":"t","type":"x"}'
    if how == "number":  # one number of the line (maybe nested deep) spelled otherwise
        numbers = list(_NUMBER.finditer(line))
        if numbers:
            found = draw(st.sampled_from(numbers))
            return line[:found.start()] + draw(st.sampled_from(ODD_NUMBERS)) + line[found.end():]
        return line
    if how == "nested-number":  # at each depth: the pattern's (up to 4), then pydantic-core's
        depth = draw(st.integers(0, 8))
        return (line[:-1] + b',"n":' + b'[{"k":' * depth + draw(st.sampled_from(ODD_NUMBERS))
                + b"}]" * depth + b"}")
    if how == "extra":  # one more member of any kind, maybe nested past the pattern's reach
        value = json.dumps(draw(json_value), separators=(",", ":")).encode(
            "utf-8", "surrogatepass")
        return line[:-1] + b',"e":' + value + b"}"
    return line


any_line = event_line().flatmap(mutated)


def has_duplicate_key(raw: bytes) -> bool:
    """Whether the strict decoder refuses ``raw`` for a key twice over, and for that alone."""
    try:
        strictjson.loads(raw)
    except strictjson.UnsafeJson as exc:
        return "duplicate key" in str(exc)
    except (ValueError, RecursionError):
        return False
    return False


def strict_seq(raw: bytes) -> int | None:
    decoded = _decode(raw)
    return None if decoded is None else decoded[0]["seq"]


# --------------------------------------------------------------------------- event log replay


def _check_heads(lines: list[bytes], heads: list[bytes] | None) -> None:
    """Each seq the fast path names is the seq the strict decoder reads from that line."""
    if heads is None:
        return
    assert len(heads) == len(lines)
    for raw, head in zip(lines, heads, strict=True):
        if head:
            seq = strict_seq(raw)
            if seq is None and has_duplicate_key(raw):
                continue  # the one documented exception: see the xfail test below
            assert seq == int(head), raw[:200]


@FAST
@given(any_line)
def test_a_line_the_replay_vouches_for_is_one_the_strict_decoder_takes(line: bytes) -> None:
    assume(b"\n" not in line)
    _check_heads([line], _plain_heads(line + b"\n"))


@FAST
@given(event_line(), st.integers(0, 8), st.sampled_from(ODD_NUMBERS), st.booleans())
def test_a_number_at_any_depth_is_vouched_for_only_when_a_double_holds_it(
    line: bytes, depth: int, number: bytes, in_list: bool
) -> None:
    """Numbers as the pattern reads them (up to 4 deep) and as pydantic-core reads them
    (deeper, which takes ``1e999`` for infinity): out of range is never vouched for."""
    inner = b"[" + number + b"]" if in_list else number
    line = line[:-1] + b',"n":' + b'[{"k":' * depth + inner + b"}]" * depth + b"}"
    assume(b"\n" not in line)
    _check_heads([line], _plain_heads(line + b"\n"))


@FAST
@given(st.lists(any_line, min_size=1, max_size=6))
def test_a_chunk_of_lines_is_vouched_for_line_by_line(lines: list[bytes]) -> None:
    """Several lines at once (the replay reads 4 KiB at a time): a line break inside a
    mutated line makes two lines, each judged on its own; nothing raises."""
    chunk = b"\n".join(lines) + b"\n"
    _check_heads(chunk.split(b"\n")[:-1], _plain_heads(chunk))


def _replay_and_records(lines: list[bytes]) -> tuple[bytes, bytes]:
    """What a socket replay sends (raw chunks) and what the strict reader reads, of a log
    holding ``lines``."""
    with tempfile.TemporaryDirectory(prefix="gw-diff-") as where:
        path = Path(where) / "events.jsonl"
        path.write_bytes(b"".join(line + b"\n" for line in lines))
        sent = b"".join(chunk.data for chunk in read_chunks(path))
        read = b"".join(rec.line.encode("utf-8") + b"\n" for rec in read_records(path))
    return sent, read


@SLOW
@given(st.lists(st.tuples(st.integers(1, 10**6).flatmap(lambda s: event_line(seq=s)),
                          st.booleans()), min_size=1, max_size=12), st.data())
def test_a_replay_sends_what_the_strict_reader_reads(
    steps: list[tuple[bytes, bool]], data: st.DataObject
) -> None:
    """End to end: the lines a socket replay passes on as stored are the lines
    `read_records` decodes, in order, and every one is JSON the client's strict decoder
    takes. Seqs run on from line to line; some lines are damaged."""
    lines = []
    for seq, (line, damage) in enumerate(steps, 1):
        line = line.replace(b'"seq":' + line.split(b'"seq":')[1].split(b",")[0],
                            b'"seq":%d' % seq, 1) if b'"seq":' in line else line
        if damage:
            line = data.draw(mutated(line))
        assume(not has_duplicate_key(line))
        lines.append(line.replace(b"\n", b" "))
    sent, read = _replay_and_records(lines)
    assert sent == read
    for raw in sent.split(b"\n")[:-1]:
        strictjson.loads(raw)  # what the client does with each line it is sent


@pytest.mark.xfail(strict=True, reason="the replay's grammar cannot see a key twice over "
                   "(docs: _plain_line_pattern): a socket replay passes on a line the "
                   "strict reader takes for damage, and the client's strict decoder refuses")
@pytest.mark.parametrize("line", [
    b'{"seq":1,"time":"t","type":"x","seq":5}',
    b'{"seq":1,"time":"t","type":"x","a":{"b":1,"b":2}}',
])
def test_a_line_with_a_key_twice_over_is_a_hole_in_a_replay_too(line: bytes) -> None:
    sent, read = _replay_and_records([line])
    assert sent == read == b""


# --------------------------------------------------------------------------- recordings


def _both_ways(raw: bytes) -> tuple[Any, Any]:
    """(what the splitter's fast path makes of one line, what `parse_jsonl_line` makes)."""
    splitter = _LineSplitter("differential")
    splitter._warnings.warning = lambda *args, **kwargs: None  # type: ignore[method-assign]
    fast = [(e.action, e.devpath, e.subsystem, dict(e.properties)) for e in splitter._parse([raw])]
    try:
        e = parse_jsonl_line(raw)
        strict = [(e.action, e.devpath, e.subsystem, dict(e.properties))]
    except MalformedLine:
        strict = []
    return fast, strict


uevent_value = st.one_of(odd_text, st.sampled_from(["add", "bind", "pci", "/devices/pci0000:00"]))


@st.composite
def uevent_line(draw: st.DrawFn) -> bytes:
    obj = draw(st.dictionaries(st.sampled_from(["ACTION", "DEVPATH", "SUBSYSTEM", "DRIVER",
                                                "SEQNUM"]) | odd_text,
                               uevent_value | odd_number.map(lambda n: n), max_size=5))
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=draw(st.booleans()))
    return text.encode("utf-8", "surrogatepass")


@FAST
@given(uevent_line().flatmap(mutated))
def test_a_recorded_line_decodes_as_the_general_parser_decodes_it(raw: bytes) -> None:
    fast, strict = _both_ways(raw)
    assert fast == strict


# --------------------------------------------------------------------------- event lines


edge_string = st.one_of(
    st.text(max_size=12),
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=12),
    st.text(alphabet=st.characters(codec=None, min_codepoint=0xD800, max_codepoint=0xDFFF)
            | st.sampled_from('"\\\x00\x1f\x7f é'), max_size=6),
    st.sampled_from(["0000:01:00.0", "nvidia", "vfio-pci", "", "\ud800", "a\udcffb"]),
)


@FAST
@given(edge_string, edge_string, edge_string, st.integers(-(2**70), 2**70), edge_string)
def test_a_driver_changed_line_is_pydantics_or_its_scrubbed_line(
    addr: str, old: str, new: str, seq: int, time: str
) -> None:
    """Formatted directly or by pydantic, the line is the same bytes; a string JSON cannot
    carry (a lone surrogate) is written as U+FFFD either way, never raised; and the line is
    strict JSON that reads back as the event."""
    fast = driver_changed(addr, old, new)
    stamp([fast], seq, time)
    line = event_json(fast)
    slow = DriverChanged(addr=addr, old=old, new=new, seq=seq, time=time)
    try:
        expected = slow.model_dump_json()
    except ValueError:  # pydantic refuses a lone surrogate: each is U+FFFD, same fields
        assert strictjson.loads(line) == scrub_surrogates(slow.model_dump())
        return
    assert line == expected
    assert parse_event(strictjson.loads(line)) == slow


# --------------------------------------------------------------------------- netlink


SUBSYSTEMS = frozenset({"pci", "drm", "vfio"})


@st.composite
def netlink_message(draw: st.DrawFn) -> bytes:
    header = draw(st.sampled_from([b"bind@/devices/pci0000:00/0000:00:01.0", b"add@", b"noat",
                                   b"libudev\0\xfe\xed\xca\xfe", b"", b"@"]))
    parts = draw(st.lists(st.one_of(
        st.sampled_from([b"SUBSYSTEM=pci", b"SUBSYSTEM=drm", b"SUBSYSTEM=usb", b"SUBSYSTEM=",
                         b"SUBSYSTEM", b"SUBSYSTEM=pci\xff", b"ACTION=bind", b"=x", b"",
                         b"SUBSYSTEMX=pci", b"XSUBSYSTEM=pci", b"K" * 3000 + b"=v"]),
        st.binary(max_size=12)), max_size=6))
    data = header + b"".join(b"\0" + p for p in parts)
    return data + (b"\0" if draw(st.booleans()) else b"")


@FAST
@given(netlink_message())
def test_the_subsystem_read_without_parsing_is_the_parsed_one(data: bytes) -> None:
    """The kernel source drops a message on `subsystem_of` before parsing it: it must keep
    every message whose parsed subsystem is followed, and drop every other one."""
    event = parse_kernel_uevent(data)
    kept = subsystem_of(data) in {s.encode() for s in SUBSYSTEMS}
    if event is not None:
        assert kept == (event.subsystem in SUBSYSTEMS)
