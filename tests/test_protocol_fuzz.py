"""Protocol fuzz against a live daemon process: at least 10,000 generated and mutated frames
(valid requests with hostile values, truncations, deep nesting, odd encodings, NaN, duplicate
keys). Every reply is strict JSON with a known code, no internal error, no traceback, and the
daemon answers every well-formed request exactly as before when the fuzz is over."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import Daemon, Lines, connect
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwatch.service import protocol as P
from gpuwatch.service.testing import short_socket_dir
from gpuwatch.testing import example_gpu_host

NV = "0000:01:00.0"
FRAMES_PER_EXAMPLE = 10  # small examples: hypothesis draws them fast, within its buffer
EXAMPLES = 1010  # x 10 frames: over 10,000
SENTINEL = P.encode_request("sentinel", "probe", {"action": "detect-gpu"})

CHECKS = [
    ("probe", {"action": a}) for a in ("detect-gpu", "detect-vfio", "detect-amd-gpu",
                                       "detect-host-devices", "amd-gfx-version")
] + [
    ("probe", {"action": "current-mode", "addr": NV}),
    ("probe", {"action": "group-in-mode", "addr": NV, "mode": "vfio"}),
    ("snapshot", {}),
]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    work = tmp_path_factory.mktemp("fuzz")
    host = example_gpu_host(work / "host")
    with short_socket_dir() as sockdir:
        d = Daemon(host.root, work, f"{sockdir}/gw.sock", "--socket-stall-timeout", "5")
        with d:
            yield d
        assert d.proc is not None and d.proc.returncode == 0, d.stderr
        assert "Traceback" not in d.stderr, d.stderr


def answers(path: str) -> list[Any]:
    with connect(path) as s:
        lines = Lines(s)
        out = []
        for i, (method, params) in enumerate(CHECKS):
            reply = lines.request(method, params, rid=i)
            if method == "snapshot":
                reply["result"].pop("seq", None)
            out.append(reply)
        return out


json_leaf = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
             | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30))
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                          max_leaves=6)
names = st.sampled_from(["action", "addr", "group", "mode", "vendor", "types", "addrs",
                         "since_seq", "timeout", "tolerant", "adr", ""])
actions = st.sampled_from(["detect-gpu", "detect-vfio", "current-mode", "group-in-mode",
                           "vfio-group-accessible", "memlock", "amd-gfx-version", "nope"])
methods = st.sampled_from([*sorted(P.READ_METHODS - {"holders", "plan"}), "switch", "recover",
                           "", "PROBE", "probe\u0000"])


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    """A request that looks right, with hostile values in it."""
    params: dict[str, Any] = {}
    if draw(st.booleans()):
        params["action"] = draw(actions)
    for _ in range(draw(st.integers(0, 3))):
        params[draw(names)] = draw(json_value)
    obj: dict[str, Any] = {"id": draw(json_value), "method": draw(methods), "params": params}
    if draw(st.integers(0, 9)) == 0:
        obj[draw(st.text(max_size=5))] = draw(json_value)
    return json.dumps(obj, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    frame = draw(requests())
    kind = draw(st.sampled_from(["truncate", "insert", "flip", "nest", "nan", "dup", "encode",
                                 "bytes"]))
    if kind == "truncate":
        return frame[: draw(st.integers(0, len(frame)))]
    if kind == "insert":
        at = draw(st.integers(0, len(frame)))
        return frame[:at] + draw(st.binary(max_size=8)) + frame[at:]
    if kind == "flip":
        at = draw(st.integers(0, max(len(frame) - 1, 0)))
        return frame[:at] + bytes([draw(st.integers(0, 255))]) + frame[at + 1:]
    if kind == "nest":
        depth = draw(st.integers(20, 3000))
        open_, close = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        body = open_ * depth + b"1" + close * depth
        return b'{"id": 1, "method": "probe", "params": {"action": ' + body + b"}}"
    if kind == "nan":
        token = draw(st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e400"]))
        return b'{"id": ' + token + b', "method": "probe", "params": {"action": "detect-gpu"}}'
    if kind == "dup":
        return b'{"id": 1, "id": 2, "method": "probe", "params": {"action": "detect-gpu"}}'
    if kind == "encode":
        text = frame.decode("utf-8", "replace")
        codec = draw(st.sampled_from(["utf-16", "utf-32", "latin-1", "utf-8-sig", "cp1252"]))
        return text.encode(codec, "replace")
    return draw(st.binary(max_size=200))  # plain garbage, NUL bytes and all


frames = st.one_of(requests(), mutated())


def check_reply(reply: Any) -> None:
    assert isinstance(reply, dict), reply
    if "seq" in reply and "type" in reply:
        return  # an event (a fuzzed subscribe succeeded)
    assert "id" in reply and ("result" in reply) != ("error" in reply), reply
    if "error" in reply:
        code = reply["error"]["code"]
        assert code in P.ERROR_CODES or code in ("bad-config", "source-unavailable"), reply
        assert code != P.INTERNAL, reply
        assert "\n" not in reply["error"]["message"]


@pytest.mark.timeout(240)
def test_ten_thousand_hostile_frames(daemon: Daemon) -> None:
    before = answers(daemon.sock)
    total = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(frames, min_size=FRAMES_PER_EXAMPLE, max_size=FRAMES_PER_EXAMPLE))
    def one_connection(batch: list[bytes]) -> None:
        with connect(daemon.sock, timeout=30) as s:
            lines = Lines(s)
            payload = b"".join(f.replace(b"\n", b" ")[: 60 << 10] + b"\n" for f in batch)
            s.sendall(payload + SENTINEL)
            while True:
                reply = lines.line()  # strict: NaN, Infinity or a duplicate key would raise
                check_reply(reply)
                if reply.get("id") == "sentinel" and "result" in reply:
                    break
        total.append(len(batch))

    one_connection()
    assert sum(total) >= 10_000
    assert daemon.proc is not None and daemon.proc.poll() is None  # still running
    assert answers(daemon.sock) == before  # and answering exactly as before
    assert os.path.exists(daemon.sock)


def test_the_client_library_decodes_without_recursion() -> None:
    from gpuwatch.service.client import DaemonUnavailable, _decode

    with pytest.raises(DaemonUnavailable):
        _decode(b"[" * 100_000 + b"]" * 100_000, "x")
    with pytest.raises(DaemonUnavailable):
        _decode(b'{"id": NaN}', "x")
    assert _decode(b'{"id": 1, "result": [[1]]}', "x") == {"id": 1, "result": [[1]]}


def test_depth_is_measured_outside_strings_only(tmp_path: Path) -> None:
    assert P.json_depth('{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}') == 1
    assert P.json_depth('["\\\\", [["\\"[["]]]') == 3
    assert P.json_depth("[" * 33 + "]" * 33) == 33
    with pytest.raises(P.UnsafeJson):
        P.loads("[" * 33 + "]" * 33)
    assert P.loads("[" * 32 + "]" * 32) is not None


@pytest.mark.parametrize("text", [
    "1" + "0" * 309,  # 310 digits: more than any double
    "-" + "9" * 309,  # 309 digits, past the largest double
    "1" + "0" * 5000,  # past CPython's own limit on digits, which would speak of its settings
], ids=["310-digits", "past-the-largest-double", "5001-digits"])
def test_an_integer_no_double_holds_is_refused_as_a_float_literal_is(text: str) -> None:
    with pytest.raises(P.UnsafeJson, match="out of range"):
        P.loads(f'{{"id": {text}}}')
    with pytest.raises(P.UnsafeJson, match="out of range"):
        P.loads(f'{{"id": {text}e0}}')  # the same number as a float literal


def test_integers_a_double_holds_are_kept_exact() -> None:
    largest = int(sys.float_info.max)  # 309 digits
    assert P.loads(str(largest)) == largest
    assert P.loads(str(-largest)) == -largest
    assert P.loads("[0, -0, 12, 9007199254740993]") == [0, 0, 12, 9007199254740993]
