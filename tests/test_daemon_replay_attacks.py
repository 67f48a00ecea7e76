"""History replays (`subscribe` with ``since_seq``) against hostile clients, on a real daemon
process and its real socket: a replaying client that reads nothing must not hold the log's
files (and its task) for ever, replays together must not take the file descriptors every
other client and the watcher need, and a log the daemon cannot read is an error reply, not
an internal error that leaves the connection half subscribed."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_helpers import Daemon, Lines, connect, probe

from gpuwatch.service import protocol as P
from gpuwatch.service.testing import short_socket_dir
from gpuwatch.testing import SysRoot
from gpuwatch.watch.eventlog import read_events

NV = "0000:01:00.0"
KEEP = 20  # --log-keep: a replay from the start holds KEEP + 1 files open
PER_FILE = 150  # lines of ~130 bytes: the whole log is far more than a socket buffer


@pytest.fixture
def sockdir() -> Iterator[str]:
    with short_socket_dir() as path:
        yield path


def write_history(work: Path) -> int:
    """A rotated log as an earlier run left it; returns its last seq."""
    seq = 0
    for index in range(KEEP, -1, -1):
        name = work / ("events.jsonl" if index == 0 else f"events.jsonl.{index}")
        lines = []
        for _ in range(PER_FILE):
            seq += 1
            lines.append(json.dumps({
                "seq": seq, "time": "2026-01-01T00:00:00.000000Z", "type": "driver-changed",
                "addr": NV, "old": "nvidia", "new": "vfio-pci"}, separators=(",", ":")))
        name.write_text("\n".join(lines) + "\n")
    return seq


def stalled_replay(path: str) -> socket.socket:
    """A client that asks for the whole history and then reads nothing."""
    s = connect(path)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(P.encode_request(1, "subscribe", {"since_seq": 0}))
    return s


def read_all(s: socket.socket, timeout: float = 30) -> list[dict[str, object]]:
    s.settimeout(timeout)
    buf = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(1 << 20):
            buf += chunk
    return [P.loads(line) for line in buf.split(b"\n") if line]


def check_exit(d: Daemon, lost: frozenset[int] = frozenset()) -> None:
    assert d.proc is not None and d.proc.returncode == 0, d.stderr
    assert "Traceback" not in d.stderr, d.stderr
    seqs = [e["seq"] for e in read_events(d.log)]
    wanted = [s for s in range(1, len(seqs) + len(lost) + 1) if s not in lost]
    assert seqs == wanted  # the log lost nothing (but what the test wrote it without)


@pytest.mark.timeout(120)
def test_a_replay_the_client_never_reads_is_lagged_and_lets_go_of_the_log(
    host: SysRoot, tmp_path: Path, sockdir: str
) -> None:
    """A replay waits for its reader, but not for ever: after --socket-stall-timeout with
    its output unread it gets the `lagged` line (where to resume) and is closed, and the
    log files it held are released, with no live event needed to push it out."""
    last = write_history(tmp_path)
    d = Daemon(host.root, tmp_path, f"{sockdir}/gw.sock", "--socket-stall-timeout", "1",
               "--socket-max-output-bytes", "4096", "--log-max-bytes", str(64 << 20),
               "--log-keep", str(KEEP))
    with d:
        idle = d.fds()
        stalled = [stalled_replay(d.sock) for _ in range(5)]
        time.sleep(3)  # well past the stall timeout, reading nothing
        assert probe(d.sock)["result"] is True
        for s in stalled:
            lines = read_all(s)  # ends: the daemon closed it (a hang is the bug)
            s.close()
            reply, *events, notice = lines
            assert reply == {"id": 1, "result": {"seq": reply["result"]["seq"],  # type: ignore[index]
                                                 "complete": True}}
            seqs = [e["seq"] for e in events]
            assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) < last
            assert notice["type"] == "lagged", notice
            assert notice["first_missed_seq"] == len(seqs) + 1
            assert notice["resume_since_seq"] == len(seqs)
        deadline = time.monotonic() + 20
        while d.fds() > idle:  # every log file the replays opened is closed again
            assert time.monotonic() < deadline, f"{d.fds()} fds held, {idle} when idle"
            time.sleep(0.05)
        # Resuming where the notice said is gapless.
        with connect(d.sock) as again:
            lines_again = Lines(again)
            lines_again.request("subscribe", {"since_seq": 100})
            assert lines_again.line()["seq"] == 101
    check_exit(d)


@pytest.mark.timeout(120)
def test_replays_together_cannot_take_the_file_descriptors_everyone_needs(
    host: SysRoot, tmp_path: Path, sockdir: str
) -> None:
    """Each replay holds the log's files while it waits for its reader. With a hard
    RLIMIT_NOFILE too low for every client to replay at once, the replays beyond what the
    limit leaves room for are refused (`unavailable`) instead of taking the descriptors
    that accepting clients, the log and the watcher's sysfs reads need."""
    write_history(tmp_path)
    d = Daemon(host.root, tmp_path, f"{sockdir}/gw.sock", "--socket-max-clients", "60",
               "--socket-max-output-bytes", "4096", "--log-max-bytes", str(64 << 20),
               "--log-keep", str(KEEP),
               nofile=(340, 340))
    with d:
        stalled = [stalled_replay(d.sock) for _ in range(58)]
        try:
            codes = []
            for s in stalled:
                reply = Lines(s).line()
                codes.append("ok" if "result" in reply else reply["error"]["code"])
            assert set(codes) <= {"ok", P.UNAVAILABLE}, codes
            assert codes.count("ok") >= 1  # some room is left for replays
            assert d.fds() < 340
            # Everyone else is still served: a new client is accepted and answered.
            reply = probe(d.sock, "current-mode", addr=NV)
            assert reply == {"id": 1, "result": "nvidia"}
            # A refused replay left nothing behind: the same connection may subscribe live.
            refused = stalled[codes.index(P.UNAVAILABLE)]
            assert Lines(refused).request("subscribe", rid=2)["result"]["complete"] is True
        finally:
            for s in stalled:
                s.close()
    check_exit(d)


@pytest.mark.timeout(60)
def test_an_unreadable_log_is_an_error_reply_and_the_connection_is_not_half_subscribed(
    host: SysRoot, tmp_path: Path, sockdir: str
) -> None:
    write_history(tmp_path)
    d = Daemon(host.root, tmp_path, f"{sockdir}/gw.sock", "--log-max-bytes", str(64 << 20),
               "--log-keep", str(KEEP))
    with d, connect(d.sock) as s:
        oldest = tmp_path / f"events.jsonl.{KEEP}"
        oldest.unlink()
        # A regular file whose read fails (EIO), even for root: the daemon's own memory at
        # address 0. (A directory there is no longer an error: readers skip it, below.)
        oldest.symlink_to("/proc/self/mem")
        lines = Lines(s)
        reply = lines.request("subscribe", {"since_seq": 0})
        assert reply["error"]["code"] == P.UNAVAILABLE, reply
        # Not subscribed: it may subscribe again (live only).
        assert lines.request("subscribe", rid=2)["result"]["complete"] is True
        assert probe(d.sock)["result"] is True
    assert d.proc is not None and d.proc.returncode == 0, d.stderr
    assert "Traceback" not in d.stderr, d.stderr


def plant(name: Path, kind: str) -> None:
    """Something no reader takes for a log file at a rotated name (or nothing at all)."""
    name.unlink()
    if kind == "directory":
        name.mkdir()
    elif kind == "fifo":
        os.mkfifo(name)
    elif kind == "socket":
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(name))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["directory", "fifo", "socket", "missing"])
def test_a_hole_in_the_rotated_log_ends_the_replay_where_it_is_and_resuming_says_incomplete(
    host: SysRoot, tmp_path: Path, sockdir: str, kind: str
) -> None:
    """A rotated name that is no log file (a directory, FIFO or socket: readers pass over
    it, and the writer never rotates into it) or a file missing from the middle leaves a
    hole in the seqs a replay can send. The reply's ``complete`` can only judge the first
    seq, so the replay stops at the hole with the `lagged` line naming it (was: it went on
    after the hole, the client never told that a whole file of seqs was missing), and
    resuming from there is answered ``complete: false``, then goes on after the hole. The
    daemon says so once, however many clients ask."""
    last = write_history(tmp_path)
    d = Daemon(host.root, tmp_path, f"{sockdir}/gw.sock", "--log-max-bytes", str(64 << 20),
               "--log-keep", str(KEEP))
    with d:
        plant(tmp_path / "events.jsonl.2", kind)
        hole = range((KEEP - 2) * PER_FILE + 1, (KEEP - 1) * PER_FILE + 1)  # its events
        for _ in range(2):
            with connect(d.sock) as s:
                lines = Lines(s)
                reply = lines.request("subscribe", {"since_seq": 0})
                assert reply["result"]["complete"] is True, reply  # seq 1 is there
                got = [lines.line() for _ in range(hole[0])]
                assert [e.get("seq") for e in got[:-1]] == list(range(1, hole[0]))
                assert got[-1] == {"type": "lagged", "missed": len(hole),
                                   "first_missed_seq": hole[0], "resume_since_seq": hole[0] - 1,
                                   "outbox_limit": 4 << 20}
                assert lines.eof()
        with connect(d.sock) as s:
            lines = Lines(s)
            reply = lines.request("subscribe", {"since_seq": hole[0] - 1})
            assert reply["result"]["complete"] is False, reply
            got = [lines.line()["seq"] for _ in range(last + 1 - hole[-1])]  # + ready
            assert got == list(range(hole[-1] + 1, last + 2))
    assert d.proc is not None and d.proc.returncode == 0, d.stderr
    assert "Traceback" not in d.stderr, d.stderr
    if kind != "missing":
        assert d.stderr.count("events.jsonl.2 is a") == 1, d.stderr


@pytest.mark.timeout(90)
def test_a_log_that_lost_its_newest_lines_ends_the_replay_with_the_hole_named(
    host: SysRoot, tmp_path: Path, sockdir: str
) -> None:
    """Seqs the daemon published but the log does not hold at its end (its last lines
    lost: a failed write, a truncation) are a hole too: the replay does not hand over to
    the live stream across it as if nothing were missing."""
    last = write_history(tmp_path)
    d = Daemon(host.root, tmp_path, f"{sockdir}/gw.sock", "--log-max-bytes", str(64 << 20),
               "--log-keep", str(KEEP))
    with d:
        log = tmp_path / "events.jsonl"
        kept = log.read_bytes().splitlines(keepends=True)[:-3]  # `ready` and two before it
        log.write_bytes(b"".join(kept))
        with connect(d.sock) as s:
            lines = Lines(s)
            reply = lines.request("subscribe", {"since_seq": last - 10})
            assert reply["result"] == {"seq": last + 1, "complete": True}, reply
            got = [lines.line() for _ in range(9)]
            assert [e.get("seq") for e in got[:-1]] == list(range(last - 9, last - 1))
            assert got[-1]["type"] == "lagged" and got[-1]["first_missed_seq"] == last - 1
            assert got[-1]["missed"] == 3, got[-1]  # last - 1, last and `ready`
            assert lines.eof()
    assert d.proc is not None and d.proc.returncode == 0, d.stderr


def test_a_fifo_log_gives_a_subscriber_live_events_marked_incomplete(
    host: SysRoot, tmp_path: Path, sockdir: str
) -> None:
    """A log written into a FIFO (another program reads it) cannot be read back: a
    subscriber asking for history gets the live stream with ``complete: false``, as an
    in-process subscriber does, not an error reply for a log it never asked to read."""
    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the program tailing it
    try:
        d = Daemon(host.root, tmp_path, f"{sockdir}/gw.sock", log=fifo, ready_by_socket=True)
        with d, connect(d.sock) as s:
            lines = Lines(s)
            reply = lines.request("subscribe", {"since_seq": 0})
            assert reply.get("result", {}).get("complete") is False, reply
            host.unbind(NV)
            d.push(host.uevent_props("unbind", NV))
            event = lines.line()
            while event.get("type") != "driver-changed":  # a probe-changed may come first
                event = lines.line()
            assert event["addr"] == NV, event
        assert d.proc is not None and d.proc.returncode == 0, d.stderr
        assert "Traceback" not in d.stderr, d.stderr
    finally:
        os.close(reader)


@pytest.mark.timeout(120)
def test_a_replay_across_a_crashs_nuls_leaves_other_clients_answered(
    host: SysRoot, tmp_path: Path, sockdir: str
) -> None:
    """A crash can leave a run of NULs in the log (blocks the file system allocated, never
    written), and lose the event they were meant for (seq 3: after them comes 4). A replay
    that must cross 64 MiB of them (the seq after 2 could be anywhere in them) reads them
    4 KiB a turn of the event loop, as any replay reads: another client's probe is answered
    while it has not got its reply yet (was: the whole region in one go on the loop, every
    client waiting ~20 s). (Were seq 3 after them, the replay would start there.)"""
    log = tmp_path / "events.jsonl"
    lines = [json.dumps({"seq": seq, "time": "2026-01-01T00:00:00.000000Z",
                         "type": "driver-changed", "addr": NV, "old": "nvidia",
                         "new": "vfio-pci"}, separators=(",", ":")) + "\n" for seq in (1, 2, 4)]
    with log.open("w") as fh:
        fh.write(lines[0] + lines[1])
        fh.truncate(fh.tell() + (64 << 20))  # sparse: NULs that cost no disk
        fh.seek(0, os.SEEK_END)
        fh.write("\n" + lines[2])  # the torn line ended, as the next writer ends it
    d = Daemon(host.root, tmp_path, f"{sockdir}/gw.sock")
    with d, connect(d.sock) as replaying:
        replaying.sendall(P.encode_request(1, "subscribe", {"since_seq": 2}))
        time.sleep(0.05)
        assert probe(d.sock)["result"] is True
        replaying.setblocking(False)
        with pytest.raises(BlockingIOError):
            replaying.recv(1)  # its reply waits for the seq after 2, past the NULs
        replaying.setblocking(True)
        got = Lines(replaying)
        assert got.line()["result"] == {"seq": 5, "complete": False}  # seq 3 was lost
        assert [got.line()["seq"] for _ in range(2)] == [4, 5]  # then `ready`, live
    check_exit(d, lost=frozenset({3}))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("since_seq", [2, 1], ids=["before-its-reply", "after-its-reply"])
async def test_a_client_that_hangs_up_inside_the_nuls_ends_its_replay(
        host: SysRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, since_seq: int,
) -> None:
    """A replay inside a crash's NULs sends nothing and the connection reads nothing, so
    only the socket can tell that its client went: it is asked at each read, and the replay
    ends at the next one (was: it read on to the end of the region, a core busy for
    seconds a client, and one reconnecting in a loop kept the daemon at it). Before its
    reply (the seq after ``since_seq`` is lost: what follows is past the NULs) and after it
    alike."""
    import anyio

    from gpuwatch.service import server as server_module
    from gpuwatch.service.testing import served_watcher

    log = tmp_path / "events.jsonl"
    with log.open("w") as fh:
        fh.write("".join(json.dumps({"seq": seq, "time": "2026-01-01T00:00:00.000000Z",
                                     "type": "resync", "reason": "reconcile", "changes": 0},
                                    separators=(",", ":")) + "\n" for seq in (1, 2)))
        fh.truncate(fh.tell() + (32 << 20))  # sparse: 8,192 reads of NULs
        fh.seek(0, os.SEEK_END)
        fh.write("\n" + json.dumps({"seq": 4, "time": "2026-01-01T00:00:00.000000Z",
                                    "type": "resync", "reason": "reconcile", "changes": 0},
                                   separators=(",", ":")) + "\n")
    reads = 0
    real = server_module.read_chunks

    def counted(*args: object, **kwargs: object) -> Iterator[object]:
        nonlocal reads
        for chunk in real(*args, **kwargs):  # type: ignore[arg-type]
            reads += 1
            yield chunk

    monkeypatch.setattr(server_module, "read_chunks", counted)
    with short_socket_dir() as sockdir:
        async with served_watcher(host.root, f"{sockdir}/gw.sock", log=str(log)) as served:
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.connect(served.path)
            client.sendall(P.encode_request(1, "subscribe", {"since_seq": since_seq}))
            with anyio.fail_after(30):
                while reads < 50:  # well inside the NULs
                    await anyio.sleep(0.01)
            client.close()
            at_hangup = reads
            with anyio.fail_after(30):
                while served.server._replays or any(
                        c.replaying for c in served.server.connections):
                    await anyio.sleep(0.01)
            assert reads - at_hangup < 1000, (at_hangup, reads)  # of 8,192
