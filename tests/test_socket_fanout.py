"""Socket fan-out: a subscriber that stops reading gets a ``lagged`` line before it is
disconnected (a real daemon process, and in-process for the edges), bursts coalesced into
few writes without losing, repeating or reordering anything, a quiet event sent at once,
pipelined requests answered in order; each in-process test for both connection kinds."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from daemon_helpers import Daemon, Lines, connect, probe
from prometheus_client.parser import text_string_to_metric_families

from gpuwatch.core.events import NodeAdded, ProbeChanged
from gpuwatch.errors import SubscriberLagged
from gpuwatch.service import protocol as P
from gpuwatch.service import server as S
from gpuwatch.service.client import AsyncClient
from gpuwatch.service.testing import served_watcher, short_socket_dir
from gpuwatch.testing import SysRoot, synthetic_host

NV, NIC = "0000:01:00.0", "0000:02:00.0"


@pytest.fixture
def sockdir() -> Iterator[str]:
    with short_socket_dir() as path:
        yield path


@pytest.fixture(params=["protocol", "stream"])
def conns(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways the server serves a connection: asyncio's transport (the daemon), and the
    reader/writer tasks it uses on any other anyio backend (forced here on asyncio)."""
    if request.param == "stream":
        monkeypatch.setattr(S, "_asyncio_loop", lambda: None)
    return str(request.param)


def _wmem_default() -> int:
    try:
        return int(Path("/proc/sys/net/core/wmem_default").read_text())
    except (OSError, ValueError):
        return 212992


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _lag_drops(port: int) -> float:
    """``gpuwatch_subscriber_lag_drops_total`` as the daemon's metrics endpoint says."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gpuwatch_subscriber_lag_drops_total":
                return float(sample.value)
    raise AssertionError("no gpuwatch_subscriber_lag_drops_total in the metrics")


def _lines(data: bytes) -> list[Any]:
    return [P.loads(line) for line in data.split(b"\n") if line]


def _read_to_eof(sock: socket.socket, timeout: float = 20) -> bytes:
    sock.settimeout(timeout)
    out = bytearray()
    try:
        while chunk := sock.recv(1 << 20):
            out += chunk
    except ConnectionResetError:
        pass
    return bytes(out)


# --------------------------------------------------------------------------- a real daemon


@pytest.mark.timeout(180)
def test_a_subscriber_that_stops_reading_gets_lagged_then_eof_and_resumes(
    tmp_path: Path, sockdir: str
) -> None:
    """The daemon process, its FIFO source and a synthetic host of 256 functions toggled
    round after round: a subscriber that reads nothing meanwhile is sent every event it
    had room for, then one ``lagged`` line saying where its loss starts, then EOF; it
    resumes gaplessly with ``since_seq``, and a subscriber that reads keeps everything."""
    host = synthetic_host(tmp_path / "host", 256)
    limit = 64 << 10
    work = tmp_path / "work"
    work.mkdir()
    port = _free_port()
    with Daemon(host.root, work, f"{sockdir}/gw.sock", "--metrics", f"127.0.0.1:{port}",
                "--socket-max-output-bytes", str(limit)) as d:
        stalled = connect(d.sock)
        first = Lines(stalled).request("subscribe")["result"]
        reader = connect(d.sock)
        Lines(reader).request("subscribe")
        got: list[int] = []
        reader.setblocking(False)
        rbuf = b""

        def drain_reader() -> None:
            nonlocal rbuf
            try:
                while chunk := reader.recv(1 << 20):
                    rbuf += chunk
            except BlockingIOError:
                pass
            *done, rbuf = rbuf.split(b"\n")
            got.extend(P.loads(line)["seq"] for line in done if line)

        def driver(addr: str) -> str | None:
            link = host.device_dir(addr) / "driver"
            return os.path.basename(os.readlink(link)) if link.is_symlink() else None

        addrs = sorted(host.functions)
        original = {a: driver(a) for a in addrs}
        log = open(d.log, "rb")  # noqa: SIM115 - closed below
        log.seek(0, os.SEEK_END)
        changes = 0
        rounds = 0
        while _lag_drops(port) == 0:  # until it overflows (the kernel's buffer, then ours)
            rounds += 1
            assert rounds < 200, "the stalled subscriber was never dropped"
            for addr in addrs:
                if driver(addr) is not None:
                    host.unbind(addr)
                    d.push(host.uevent_props("unbind", addr))
                else:
                    host.bind(addr, original[addr] or "vfio-pci")
                    d.push(host.uevent_props("bind", addr))
            deadline = time.monotonic() + 30
            while changes < rounds * len(addrs):  # the round is applied and logged
                assert time.monotonic() < deadline, "the daemon did not apply a round"
                chunk = log.read()
                changes += chunk.count(b'"type":"driver-changed"')
                drain_reader()
                time.sleep(0.01)
        log.close()
        last = d.seq()

        lines = _lines(_read_to_eof(stalled))
        stalled.close()
        *events, notice = lines
        assert notice["type"] == "lagged" and "seq" not in notice, notice
        seqs = [e["seq"] for e in events]
        assert seqs == list(range(first["seq"] + 1, first["seq"] + 1 + len(seqs)))
        assert notice["first_missed_seq"] == (seqs[-1] if seqs else first["seq"]) + 1
        assert notice["resume_since_seq"] == notice["first_missed_seq"] - 1
        assert notice["missed"] >= 1 and notice["first_missed_seq"] <= last
        assert sum(len(json.dumps(e)) for e in events) < limit + 2 * _wmem_default()

        # The reader lost nothing, and the daemon still answers.
        deadline = time.monotonic() + 20
        while not got or got[-1] < last:
            assert time.monotonic() < deadline, "the reading subscriber fell behind"
            drain_reader()
            time.sleep(0.01)
        assert got == list(range(first["seq"] + 1, last + 1))
        reader.close()
        assert "result" in probe(d.sock, "detect-vfio")

        # Resuming where the notice says misses nothing and repeats nothing.
        with connect(d.sock) as again:
            lines_again = Lines(again)
            reply = lines_again.request("subscribe",
                                        {"since_seq": notice["resume_since_seq"]})["result"]
            assert reply["complete"] is True
            assert lines_again.line()["seq"] == notice["first_missed_seq"]
    assert d.proc is not None and d.proc.returncode == 0, d.stderr
    assert "Traceback" not in d.stderr, d.stderr


# --------------------------------------------------------------------------- in-process


async def _subscriber(path: str, params: dict[str, Any] | None = None,
                      ) -> tuple[socket.socket, int]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.connect(path)
    sock.send(P.encode_request(1, "subscribe", params))
    buf = b""
    with anyio.fail_after(5):
        while b"\n" not in buf:
            await anyio.wait_readable(sock)
            buf += sock.recv(65536)
    return sock, P.loads(buf.split(b"\n")[0])["result"]["seq"]


async def _read_lines(sock: socket.socket, count: int, timeout: float = 10) -> list[Any]:
    return _lines(await _read_bytes(sock, count, timeout))


async def test_a_quiet_event_is_written_before_publish_returns(
    host: SysRoot, sockdir: str, conns: str
) -> None:
    async with served_watcher(host.root, f"{sockdir}/gw.sock") as served:
        sock, seq = await _subscriber(served.path)
        await anyio.sleep(2 * S.FLUSH_WINDOW)  # quiet: nothing flushed within the window
        served.watcher.publish([NodeAdded(path="/dev/quiet")])
        # No await since: the line is in the socket already, not held for a later flush.
        [line] = _lines(sock.recv(65536))
        assert line["seq"] == seq + 1 and line["type"] == "node-added"
        sock.close()


async def test_a_burst_is_coalesced_without_loss_repeat_or_reorder(
    host: SysRoot, sockdir: str, conns: str
) -> None:
    """Slices published back to back while subscribers of every kind come and go: each
    gets exactly its events, in order, and a reply on a subscribed connection never
    overtakes an event published before it was asked."""
    async with served_watcher(host.root, f"{sockdir}/gw.sock") as served:
        w = served.watcher
        everyone, base = await _subscriber(served.path)
        only_even, _ = await _subscriber(served.path, {"types": ["node-added"]})
        late: socket.socket | None = None
        late_seq = 0
        slices, size = 40, 64
        published = 0
        for k in range(slices):
            batch: list[Any] = []
            for i in range(size):
                n = k * size + i
                batch.append(NodeAdded(path=f"/dev/b{n}") if n % 2 == 0 else
                             ProbeChanged(action="detect-gpu", old=n, new=n + 1))
            w.publish(batch)
            published += size
            if k == 10:
                late, late_seq = await _subscriber(served.path)
            if k == 20:
                # A request on a subscribed connection: its reply after the events so far.
                everyone.send(P.encode_request("mid", "probe", {"action": "detect-gpu"}))
            await anyio.lowlevel.checkpoint()
        got = await _read_lines(everyone, published + 1)
        reply = [i for i, line in enumerate(got) if "id" in line]
        assert len(reply) == 1 and got[reply[0]]["id"] == "mid"
        events = [line["seq"] for line in got if "id" not in line]
        assert events == list(range(base + 1, base + 1 + published))
        assert reply[0] >= 21 * size  # every event published before the request came first
        even = await _read_lines(only_even, published // 2)
        assert [e["seq"] for e in even] == list(range(base + 1, base + 1 + published, 2))
        assert {e["type"] for e in even} == {"node-added"}
        assert late is not None
        tail = await _read_lines(late, base + published - late_seq)
        assert [e["seq"] for e in tail] == list(range(late_seq + 1, base + published + 1))
        for s in (everyone, only_even, late):
            s.close()


async def test_lagged_line_counts_what_was_dropped_and_the_client_raises(
    host: SysRoot, sockdir: str, conns: str
) -> None:
    pad = "p" * 4000
    async with served_watcher(host.root, f"{sockdir}/gw.sock", outbox_limit=64 << 10) as served:
        w = served.watcher
        client = await AsyncClient.connect(served.path)
        reply = await client.subscribe(types=["probe-changed"])
        with anyio.fail_after(20):
            while served.server.lag_drops == 0:
                w.publish([ProbeChanged(action="detect-gpu", old=pad, new=pad)])
                await anyio.sleep(0)
        last = w.seq
        received: list[int] = []
        with anyio.fail_after(10), pytest.raises(SubscriberLagged) as info:
            async for event in client.events():
                received.append(event["seq"])
        await client.aclose()
        assert received == list(range(reply["seq"] + 1, reply["seq"] + 1 + len(received)))
        assert info.value.first_missed_seq == (received[-1] if received else reply["seq"]) + 1
        assert info.value.missed >= 1
        assert info.value.first_missed_seq + info.value.missed - 1 <= last
        assert f"since_seq={info.value.first_missed_seq - 1}" in str(info.value)
        # The server lets go of the connection once it sees the hang-up: a turn of its own,
        # which may come after the client's close returns.
        with anyio.fail_after(5):
            while served.server.connections:
                await anyio.sleep(0.01)
        assert served.server.lag_drops == 1


async def test_a_lagged_client_that_reads_nothing_is_closed_after_the_grace(
    host: SysRoot, sockdir: str, conns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(S, "_LAG_GRACE", 0.2)
    pad = "q" * 4000
    async with served_watcher(host.root, f"{sockdir}/gw.sock", outbox_limit=64 << 10) as served:
        sock, _ = await _subscriber(served.path)
        with anyio.fail_after(20):
            while served.server.lag_drops == 0:
                served.watcher.publish([ProbeChanged(action="detect-gpu", old=pad, new=pad)])
                await anyio.sleep(0)
            while served.server.connections:  # never read: dropped anyway, soon
                await anyio.sleep(0.02)
        # What the kernel held is still readable, then EOF; no more than the bound.
        data = await anyio.to_thread.run_sync(_read_to_eof, sock)
        assert len(data) < (64 << 10) + 4 * _wmem_default()
        sock.close()


async def _read_bytes(sock: socket.socket, count: int, timeout: float = 20) -> bytes:
    """Exactly the bytes of the next ``count`` lines (as sent, not parsed)."""
    buf = b""
    with anyio.fail_after(timeout):
        while buf.count(b"\n") < count:
            await anyio.wait_readable(sock)
            chunk = sock.recv(1 << 20)
            assert chunk, "closed early"
            buf += chunk
    return buf


def _count_writes(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """Writes per connection (by id), for both connection kinds."""
    writes: dict[int, int] = {}
    for cls in (S._ProtocolConnection, S._StreamConnection):
        inner = cls._write

        def counted(self: Any, data: Any, inner: Any = inner) -> None:
            writes[id(self)] = writes.get(id(self), 0) + 1
            inner(self, data)

        monkeypatch.setattr(cls, "_write", counted)
    return writes


async def test_filtered_subscribers_take_a_burst_in_one_write_of_the_same_bytes(
    host: SysRoot, sockdir: str, conns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Subscribers with a filter get a coalesced burst as those without one do: one write
    per flush (the filter applied once per distinct filter, not per subscriber and batch),
    holding byte for byte the lines an unfiltered subscriber got for those events."""
    writes = _count_writes(monkeypatch)
    async with served_watcher(host.root, f"{sockdir}/gw.sock", flush_window=30.0) as served:
        w = served.watcher
        peer: dict[socket.socket, int] = {}  # each client's connection in the server

        async def subscribe(params: dict[str, Any] | None = None) -> tuple[socket.socket, int]:
            known = set(peer.values())
            sock, seq = await _subscriber(served.path, params)
            [peer[sock]] = [id(c) for c in served.server.connections if id(c) not in known]
            return sock, seq

        everyone, base = await subscribe()
        nodes = [(await subscribe({"types": ["node-added"]}))[0] for _ in range(2)]
        probes, _ = await subscribe({"types": ["probe-changed"]})
        await anyio.sleep(2 * S.FLUSH_WINDOW)  # quiet: the first slice goes out at once
        before = {s: writes.get(peer[s], 0) for s in peer}
        slices, size = 20, 64
        for k in range(slices):
            w.publish([NodeAdded(path=f"/dev/f{k}-{i}") if i % 3 else
                       ProbeChanged(action="detect-gpu", old=k, new=i) for i in range(size)])
            await anyio.lowlevel.checkpoint()
        total = slices * size
        all_bytes = await _read_bytes(everyone, total)
        lines = all_bytes.splitlines(keepends=True)
        assert [P.loads(x)["seq"] for x in lines] == list(range(base + 1, base + 1 + total))
        want_nodes = b"".join(x for x in lines if P.loads(x)["type"] == "node-added")
        want_probes = b"".join(x for x in lines if P.loads(x)["type"] == "probe-changed")
        for s in nodes:
            assert await _read_bytes(s, want_nodes.count(b"\n")) == want_nodes
        assert await _read_bytes(probes, want_probes.count(b"\n")) == want_probes
        # The quiet first slice, then everything held since in one flush: two writes each.
        assert {s: writes.get(peer[s], 0) - before[s] for s in peer} == dict.fromkeys(peer, 2)
        for s in (everyone, *nodes, probes):
            s.close()


async def test_a_subscriber_whose_socket_is_full_gets_the_same_bytes_in_order(
    host: SysRoot, sockdir: str, conns: str
) -> None:
    """A flush the socket takes whole and one it takes only in part (the rest queued in the
    server, sent as the client reads) deliver the same bytes: a subscriber that reads
    nothing while several socket buffers' worth is published, then reads, gets byte for
    byte what one that kept up got, and no `lagged` line (it stayed under its limit)."""
    pad = "z" * 3000
    async with served_watcher(host.root, f"{sockdir}/gw.sock") as served:
        w = served.watcher
        fast, base = await _subscriber(served.path)
        slow, _ = await _subscriber(served.path)
        queued = total = 0
        fast_bytes = b""
        while total * len(pad) < 4 * _wmem_default():
            w.publish([ProbeChanged(action="detect-gpu", old=f"{pad}{total + i}", new=i)
                       for i in range(8)])
            total += 8
            await anyio.lowlevel.checkpoint()
            queued = max(queued, *(c.buffered() for c in served.server.connections))
            with contextlib.suppress(BlockingIOError):
                fast_bytes += fast.recv(1 << 20)  # keeps up (non-blocking)
        assert queued > 0  # some flush did not fit the slow one's socket: it was queued
        fast_bytes += await _read_bytes(fast, total - fast_bytes.count(b"\n"))
        slow_bytes = await _read_bytes(slow, total)
        assert slow_bytes == fast_bytes
        seqs = [P.loads(x)["seq"] for x in slow_bytes.splitlines()]
        assert seqs == list(range(base + 1, base + 1 + total))
        assert served.server.lag_drops == 0
        fast.close()
        slow.close()


async def test_pipelined_requests_are_answered_in_order(
    host: SysRoot, sockdir: str, conns: str
) -> None:
    """Requests sent in one write, some answered from memory and some in a task (a /proc
    read, a plan): the replies come in the order asked."""
    async with served_watcher(host.root, f"{sockdir}/gw.sock") as served:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.connect(served.path)
        reqs = [("probe", {"action": "detect-gpu"}), ("probe", {"action": "wedge-detected"}),
                ("snapshot", None), ("holders", {"addr": NV}),
                ("probe", {"action": "plan", "mode": "vfio", "addr": NV}),
                ("probe", {"action": "nope"}), ("probe", {"action": "detect-vfio"})] * 30
        sock.send(b"".join(P.encode_request(i, m, p) for i, (m, p) in enumerate(reqs)))
        got = await _read_lines(sock, len(reqs), timeout=60)
        assert [r["id"] for r in got] == list(range(len(reqs)))
        assert got[0]["result"] is True and got[5]["error"]["code"] == P.INVALID_PARAMS
        assert got[1]["result"] is False and got[2]["result"]["seq"] == served.watcher.seq
        sock.close()
