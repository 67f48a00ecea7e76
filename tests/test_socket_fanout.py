"""Socket fan-out: a subscriber that stops reading gets a ``lagged`` line before it is
disconnected (a real daemon process, and in-process for the edges), bursts coalesced into
few writes without losing, repeating or reordering anything, a quiet event sent at once,
pipelined requests answered in order; each in-process test for both connection kinds."""

from __future__ import annotations

import contextlib
import errno
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
from gpuwatch.service.sharedsend import MIN_BYTES, MIN_SHARERS, SharedBytes
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

        def counted(self: Any, data: Any, shared: Any = None, inner: Any = inner) -> None:
            writes[id(self)] = writes.get(id(self), 0) + 1
            inner(self, data, shared)

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


# --------------------------------------------------------------------------- one copy for many


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _spy_shared(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes each `SharedBytes.send_to` call handed over by page reference."""
    taken: list[int] = []
    inner = SharedBytes.send_to

    def spied(self: SharedBytes, sock_fd: int) -> int:
        n = inner(self, sock_fd)
        taken.append(n)
        return n

    monkeypatch.setattr(SharedBytes, "send_to", spied)
    return taken


async def _burst_to_many(served: Any, socks: list[socket.socket], slow: list[socket.socket],
                         rounds: int) -> tuple[int, list[bytes]]:
    """``rounds`` flushes of one large burst each, while the ``slow`` subscribers read
    nothing (their sockets fill: the kernel takes a flush only in part) and the others read
    as it comes; then everything each one got."""
    w = served.watcher
    pad = "s" * 900
    got = {s: b"" for s in socks}
    total = 0
    for r in range(rounds):
        for k in range(8):  # slices held, then flushed together (above MIN_BYTES)
            w.publish([ProbeChanged(action="detect-gpu", old=f"{pad}{r}.{k}.{i}", new=i)
                       for i in range(16)])
            total += 16
        served.server._flush()
        for s in socks:
            if s not in slow:
                with contextlib.suppress(BlockingIOError):
                    got[s] += s.recv(1 << 22)
    for s in socks:
        got[s] += await _read_bytes(s, total - got[s].count(b"\n"))
    return total, [got[s] for s in socks]


async def test_a_burst_many_subscribers_share_goes_to_the_kernel_once_byte_for_byte(
    host: SysRoot, sockdir: str, conns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Subscribers enough to share one copy (`SharedBytes`): each gets byte for byte the
    lines of a subscriber the plain path serves (a filter of its own), in order, whether
    its socket took a flush whole, took it in part (it read nothing meanwhile: the rest is
    queued behind what the kernel took), or still held earlier output (then nothing may go
    ahead of it). The shared file is closed after each flush, and the pages the sockets
    still hold arrive unchanged after later flushes."""
    taken = _spy_shared(monkeypatch)
    fds = _open_fds()
    async with served_watcher(host.root, f"{sockdir}/gw.sock", flush_window=30.0) as served:
        slow = [(await _subscriber(served.path))[0] for _ in range(2)]
        for conn in served.server.connections:  # a flush is more than their sockets hold
            with socket.socket(fileno=os.dup(conn.fileno())) as theirs:
                theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 << 10)
        plain, base = await _subscriber(served.path, {"types": ["probe-changed"]})
        many = [*slow, *[(await _subscriber(served.path))[0] for _ in range(MIN_SHARERS)]]
        socks = [plain, *many]
        total, got = await _burst_to_many(served, socks, slow, rounds=12)
        seqs = [P.loads(x)["seq"] for x in got[0].splitlines()]
        assert seqs == list(range(base + 1, base + 1 + total))
        for data in got[1:]:
            assert data == got[0]
        assert served.server.lag_drops == 0
        # The shared path ran: sockets took whole flushes, and some took part of one.
        lines = got[0].splitlines(keepends=True)
        per_round = total // 12
        flushes = {len(b"".join(lines[r * per_round:(r + 1) * per_round])) for r in range(12)}
        assert min(flushes) >= MIN_BYTES
        assert any(n in flushes for n in taken)
        assert any(0 < n < min(flushes) for n in taken)
        assert len(taken) <= 12 * len(many)  # never for the plain subscriber
        for s in socks:
            s.close()
    assert _open_fds() <= fds  # every shared file closed


async def test_without_memfd_or_sendfile_the_same_bytes_go_the_plain_way(
    host: SysRoot, sockdir: str, conns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seccomp profile that refuses ``memfd_create`` (ENOSYS): the fan-out copies per
    socket as before, byte for byte, and stops asking for the file after the refusal."""

    calls = []

    def refused(*args: Any) -> int:
        calls.append(args)
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(os, "memfd_create", refused)
    monkeypatch.setattr(SharedBytes, "supported", True)
    async with served_watcher(host.root, f"{sockdir}/gw.sock", flush_window=30.0) as served:
        socks = [(await _subscriber(served.path))[0] for _ in range(MIN_SHARERS)]
        base = served.watcher.seq
        total, got = await _burst_to_many(served, socks, socks[:1], rounds=3)
        assert [P.loads(x)["seq"] for x in got[0].splitlines()] == list(
            range(base + 1, base + 1 + total))
        assert all(data == got[0] for data in got)
        for s in socks:
            s.close()
    assert len(calls) == 1 and SharedBytes.supported is False


def _spy_sendfile_errors(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The errno of each ``os.sendfile`` call that failed."""
    errs: list[int] = []
    inner = os.sendfile

    def spied(*args: Any) -> int:
        try:
            return inner(*args)
        except OSError as exc:
            errs.append(exc.errno or 0)
            raise

    monkeypatch.setattr(os, "sendfile", spied)
    return errs


async def _held_burst(served: Any, tag: str) -> int:
    """Eight slices held for one flush (above `MIN_BYTES`): how many events."""
    pad = "g" * 900
    for k in range(8):
        served.watcher.publish([ProbeChanged(action="detect-gpu", old=f"{pad}{tag}.{k}.{i}",
                                             new=i) for i in range(16)])
    return 8 * 16


def _recv_now(sock: socket.socket) -> bytes:
    out = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := sock.recv(1 << 22):
            out += chunk
    return out


async def test_subscribers_that_hang_up_mid_burst_leave_the_others_whole(
    host: SysRoot, sockdir: str, conns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two of those sharing a flush hang up while the burst is held, before the daemon's
    loop sees it (one closes with events unread: ECONNRESET; one shuts its read side:
    EPIPE), so their ``sendfile`` meets the error: they are let go as a plain send would,
    the others get every byte in order, the path stays on, and no shared file is left open."""
    errs = _spy_sendfile_errors(monkeypatch)
    monkeypatch.setattr(SharedBytes, "supported", True)
    fds = _open_fds()
    async with served_watcher(host.root, f"{sockdir}/gw.sock", flush_window=30.0) as served:
        socks = [(await _subscriber(served.path))[0] for _ in range(MIN_SHARERS + 2)]
        reset, shut, live = socks[0], socks[1], socks[2:]
        base = served.watcher.seq
        got = {s: b"" for s in live}
        total = 0
        for r in range(3):
            total += await _held_burst(served, str(r))  # the first slice went out at once
            if r == 1:  # no await since: the loop has not seen either hang-up
                reset.close()
                shut.shutdown(socket.SHUT_RD)
            served.server._flush()
            for s in live:
                got[s] += _recv_now(s)
        assert errs and set(errs) <= {errno.EPIPE, errno.ECONNRESET}, errs
        assert SharedBytes.supported is True
        for s in live:
            got[s] += await _read_bytes(s, total - got[s].count(b"\n"))
        first = got[live[0]]
        assert [P.loads(x)["seq"] for x in first.splitlines()] == list(
            range(base + 1, base + 1 + total))
        assert all(got[s] == first for s in live)
        with anyio.fail_after(5):
            while len(served.server.connections) > len(live):
                await anyio.sleep(0.01)
        for s in socks[1:]:
            s.close()
    assert _open_fds() <= fds


async def test_out_of_descriptors_a_flush_goes_the_plain_way_and_the_next_shares(
    host: SysRoot, sockdir: str, conns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``memfd_create`` refused with EMFILE (the daemon at its RLIMIT_NOFILE for a moment)
    is a passing shortage: that flush is copied per socket, byte for byte, and the next
    one shares again (the path is not given up for good)."""
    calls: list[int] = []
    inner = os.memfd_create

    def short_once(*args: Any) -> int:
        calls.append(len(calls))
        if len(calls) == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        return inner(*args)

    monkeypatch.setattr(os, "memfd_create", short_once)
    monkeypatch.setattr(SharedBytes, "supported", True)
    taken = _spy_shared(monkeypatch)
    async with served_watcher(host.root, f"{sockdir}/gw.sock", flush_window=30.0) as served:
        socks = [(await _subscriber(served.path))[0] for _ in range(MIN_SHARERS)]
        base = served.watcher.seq
        got = {s: b"" for s in socks}
        total = 0
        for r in range(2):
            total += await _held_burst(served, str(r))
            served.server._flush()
            for s in socks:
                got[s] += _recv_now(s)
            if r == 0:
                assert SharedBytes.supported is True and not any(taken)
        assert len(calls) == 2 and any(taken)
        for s in socks:
            got[s] += await _read_bytes(s, total - got[s].count(b"\n"))
        first = got[socks[0]]
        assert [P.loads(x)["seq"] for x in first.splitlines()] == list(
            range(base + 1, base + 1 + total))
        assert all(got[s] == first for s in socks)
        for s in socks:
            s.close()


@pytest.mark.timeout(30)
def test_shared_bytes_are_taken_in_part_by_a_full_socket_and_survive_the_close() -> None:
    """`SharedBytes.send_to` on a non-blocking socket: what the socket takes, how much
    (less than all when it is full), and pages the reader gets after the file is closed,
    and after other files wrote other bytes, are the bytes written."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        a.setblocking(False)
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        data = bytes(range(256)) * 4096  # 1 MiB: more than the socket holds
        shared = SharedBytes(data)
        assert shared.fd >= 0
        took = shared.send_to(a.fileno())
        shared.close()
        assert 0 < took < len(data)
        other = SharedBytes(b"x" * len(data))  # new pages, written after the close
        other.close()
        b.settimeout(5)
        got = b""
        while len(got) < took:
            got += b.recv(1 << 20)
        assert got == data[:took]
        assert SharedBytes(b"").send_to(a.fileno()) == 0


@pytest.mark.timeout(30)
def test_a_memfd_is_made_sealed_against_exec_and_asked_again_on_an_old_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``vm.memfd_noexec=2`` (Linux 6.3+) refuses a memfd made without
    ``MFD_NOEXEC_SEAL`` (EACCES): the file is asked for with it, so sharing stays on there;
    a kernel before 6.3 does not know the flag (EINVAL) and is asked again without it."""
    import errno

    seal = 0x0008
    real = os.memfd_create
    asked: list[int] = []

    def noexec_2(name: str, flags: int = 0) -> int:  # a 6.3+ kernel with memfd_noexec=2
        asked.append(flags)
        if not flags & seal:
            raise OSError(errno.EACCES, "Permission denied")
        return real(name, flags & ~seal)  # (this machine's kernel may not know it either)

    monkeypatch.setattr(SharedBytes, "supported", True)
    monkeypatch.setattr(SharedBytes, "flags", SharedBytes.flags)
    monkeypatch.setattr(os, "memfd_create", noexec_2)
    shared = SharedBytes(b"x" * 100)
    assert shared.fd >= 0 and SharedBytes.supported
    shared.close()
    assert asked == [asked[0]] and asked[0] & seal

    def before_6_3(name: str, flags: int = 0) -> int:
        asked.append(flags)
        if flags & seal:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(name, flags)

    asked.clear()
    monkeypatch.setattr(os, "memfd_create", before_6_3)
    for _ in range(2):
        shared = SharedBytes(b"y" * 100)
        assert shared.fd >= 0
        shared.close()
    assert [bool(f & seal) for f in asked] == [True, False, False]  # asked with it once
    assert SharedBytes.supported


@pytest.mark.timeout(30)
def test_one_socket_refusing_sendfile_does_not_end_sharing_for_everyone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A security module that refuses ``sendfile`` to one client's socket (EACCES): that
    socket gets nothing by reference (its caller sends plainly), the others still do, and
    sharing stays on. Every socket refused, time after time, turns it off."""
    import errno

    real = os.sendfile
    refused: set[int] = set()

    def some_refused(out_fd: int, in_fd: int, offset: int | None, count: int) -> int:
        if out_fd in refused:
            raise OSError(errno.EACCES, "Permission denied")
        return real(out_fd, in_fd, offset, count)

    monkeypatch.setattr(SharedBytes, "supported", True)
    monkeypatch.setattr(SharedBytes, "refusals", 0)
    monkeypatch.setattr(os, "sendfile", some_refused)
    pairs = [socket.socketpair() for _ in range(4)]
    try:
        refused.add(pairs[0][0].fileno())
        data = b"z" * 4096
        for _ in range(20):  # more rounds than refusals in a row would stop it
            shared = SharedBytes(data)
            took = [shared.send_to(a.fileno()) for a, _ in pairs]
            shared.close()
            assert took == [0, len(data), len(data), len(data)]
            for _, b in pairs[1:]:
                assert b.recv(1 << 16) == data
        assert SharedBytes.supported
        refused.update(a.fileno() for a, _ in pairs)
        for _ in range(3):
            shared = SharedBytes(data)
            assert [shared.send_to(a.fileno()) for a, _ in pairs] == [0, 0, 0, 0]
            shared.close()
        assert not SharedBytes.supported
    finally:
        for a, b in pairs:
            a.close()
            b.close()
