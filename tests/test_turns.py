"""`end_turn`: a request that arrives during one turn of a task's work is answered before the
next turn, on the event loop the daemon runs (asyncio), with a real socket's readiness; and so
on the daemon's socket during a history replay and during a backlog of uevents.

No timings: the assertions are about the order in which the loop runs things.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from gpuwatch.service import protocol as P
from gpuwatch.service.server import (
    _LAG_RESERVE,
    _REPLAY_BLOCK,
    _REPLAY_BLOCK_TURNS,
    Connection,
    _ReplayBlock,
)
from gpuwatch.service.testing import served_watcher, short_socket_dir
from gpuwatch.sources.memory import MemorySource
from gpuwatch.sources.turns import end_turn
from gpuwatch.testing import SysRoot
from gpuwatch.watch.eventlog import _REPLAY_CHUNK, RawChunk
from gpuwatch.watch.watcher import PUMP_SLICE

NV = "0000:01:00.0"


async def turn_answered_in(give_way: Callable[[], Awaitable[None]], turns: int = 4) -> int:
    """Run ``turns`` turns of a task that gives way with ``give_way`` between them; during
    turn 1 a byte arrives on a real socket whose reader callback answers it. Returns the
    number of the turn that had started when the callback ran (1: before turn 2)."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    current = 0
    answered_during: list[int] = []

    def on_readable() -> None:
        ours.recv(16)
        answered_during.append(current)
        loop.remove_reader(ours.fileno())

    loop.add_reader(ours.fileno(), on_readable)
    try:
        for turn in range(turns):
            current = turn
            if turn == 1:
                theirs.send(b"x")  # the request comes in while this turn works
            await give_way()
        await asyncio.sleep(0.01)
        return answered_during[0]
    finally:
        loop.remove_reader(ours.fileno())
        ours.close()
        theirs.close()


async def test_a_request_that_arrives_during_a_turn_is_answered_before_the_next() -> None:
    assert await turn_answered_in(end_turn) == 1


async def test_one_checkpoint_leaves_the_request_behind_the_next_turn() -> None:
    # Why `end_turn` exists: the single checkpoint queues turn 2 before the poll's callback.
    assert await turn_answered_in(anyio.lowlevel.checkpoint) == 2


async def test_tasks_ready_before_the_turn_ended_run_before_the_next_turn() -> None:
    order: list[str] = []

    async def other() -> None:
        order.append("other")

    async def worker() -> None:
        order.append("turn 1")
        task = asyncio.get_running_loop().create_task(other())
        await end_turn()
        order.append("turn 2")
        await task

    await worker()
    assert order == ["turn 1", "other", "turn 2"]


# --------------------------------------------------------------------------- where it is used


def peek_reply(sock: socket.socket) -> bool:
    """Whether a reply has arrived on ``sock`` (without taking it)."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return False


def probe_client(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return sock


PROBE = P.encode_request(7, "probe", {"action": "detect-gpu"})


async def test_a_probe_sent_during_a_replay_turn_is_answered_before_the_next(
    host: SysRoot, tmp_path: Path
) -> None:
    log = tmp_path / "events.jsonl"
    line = ('{"seq":%d,"time":"2026-01-01T00:00:00.000000Z","type":"driver-changed",'
            '"addr":"0000:01:00.0","old":"nvidia","new":"vfio-pci"}\n')
    log.write_text("".join(line % seq for seq in range(1, 301)))  # ~40 KiB: ten turns
    turns: list[bool] = []  # per turn after the probe: was it answered when the turn began?
    with short_socket_dir() as sockdir:
        path = f"{sockdir}/gw.sock"
        async with served_watcher(host.root, path, log=str(log)) as served:
            prober = probe_client(path)
            history = served.server._history

            def watched_history(since_seq: int, sub: Any) -> Iterator[Any]:
                for index, chunk in enumerate(history(since_seq, sub)):
                    if index == 1:
                        prober.sendall(PROBE)  # arrives while this turn works
                    elif index > 1:
                        turns.append(peek_reply(prober))
                    yield chunk

            served.server._history = watched_history  # type: ignore[method-assign]
            with prober, probe_client(path) as replayer:
                replayer.sendall(P.encode_request(1, "subscribe", {"since_seq": 0}))
                with anyio.fail_after(10):
                    while len(turns) < 3:
                        await anyio.sleep(0.005)
                reply = P.loads(prober.recv(1 << 16).partition(b"\n")[0])
    assert reply["id"] == 7 and "result" in reply
    assert turns[0] is True, turns  # answered before the turn after the one it came in


async def test_a_probe_sent_during_a_slice_of_a_backlog_is_answered_before_the_next(
    host: SysRoot
) -> None:
    slices_begun = 0
    answered_at: list[int] = []  # the slice whose start first saw the reply
    with short_socket_dir() as sockdir:
        path = f"{sockdir}/gw.sock"
        async with served_watcher(host.root, path) as served:
            w = served.watcher
            inner = w.apply
            prober = probe_client(path)

            def counting(observations: Any) -> Any:
                nonlocal slices_begun
                slices_begun += 1
                if slices_begun == 2:
                    prober.sendall(PROBE)  # arrives while this slice works
                elif slices_begun > 2 and not answered_at and peek_reply(prober):
                    answered_at.append(slices_begun)
                return inner(observations)

            w.apply = counting  # type: ignore[method-assign]
            with prober:
                source = served.source
                assert isinstance(source, MemorySource)
                for i in range(PUMP_SLICE * 8):  # distinct devices: one batch, eight slices
                    source.push({"ACTION": "change", "SUBSYSTEM": "pci",
                                 "DEVPATH": f"/devices/pci0000:00/0000:{i >> 8:02x}:"
                                            f"{i & 31:02x}.{(i >> 5) & 7}"})
                with anyio.fail_after(10):
                    while slices_begun < 8:
                        await anyio.sleep(0.005)
                reply = P.loads(prober.recv(1 << 16).partition(b"\n")[0])
    assert reply["id"] == 7 and "result" in reply
    assert answered_at == [3], (answered_at, slices_begun)


async def read_until_seq(stream: Any, seq: int) -> bytes:
    got = b""
    needle = b'"seq":%d,' % seq
    with anyio.fail_after(20):
        while needle not in got:
            got += await stream.receive()
    return got


async def test_a_replay_goes_out_in_blocks_and_a_sparse_filtered_one_as_it_goes(
    host: SysRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay reads 4 KiB a turn but writes `_REPLAY_BLOCK` bytes at a time (a write per
    chunk woke a fast reader for every 4 KiB); a filtered replay that finds little writes
    what it found every `_REPLAY_BLOCK_TURNS` turns, not once at the end."""
    log = tmp_path / "events.jsonl"
    rare, common = "0000:02:00.0", "0000:01:00.0"
    line = ('{"seq":%d,"time":"2026-01-01T00:00:00.000000Z","type":"driver-changed",'
            '"addr":"%s","old":"nvidia","new":"vfio-pci"}\n')
    total = 3000
    text = "".join(line % (seq, rare if seq % 50 == 0 else common) for seq in range(1, total + 1))
    log.write_text(text)
    writes: dict[bool, list[int]] = {False: [], True: []}  # filtered? -> each write's size
    deliver = Connection.deliver

    def counting(self: Connection, data: bytes, first_seq: int, count: int) -> None:
        if self.sub is not None and first_seq <= total:
            writes[self.sub.addrs is not None].append(len(data))
        deliver(self, data, first_seq, count)

    monkeypatch.setattr(Connection, "deliver", counting)
    with short_socket_dir() as sockdir:
        path = f"{sockdir}/gw.sock"
        async with served_watcher(host.root, path, log=str(log)), \
                await anyio.connect_unix(path) as everything, \
                await anyio.connect_unix(path) as sparse:
            await everything.send(P.encode_request(1, "subscribe", {"since_seq": 0}))
            await sparse.send(P.encode_request(1, "subscribe", {"since_seq": 0, "addrs": [rare]}))
            whole = await read_until_seq(everything, total)
            few = await read_until_seq(sparse, total)
    assert whole.partition(b"\n")[2].startswith(text.encode())  # as stored, in order
    assert few.count(b'"type":"driver-changed"') == total // 50
    all_writes, sparse_writes = writes[False], writes[True]
    chunks = -(-len(text) // _REPLAY_CHUNK)
    assert len(all_writes) <= -(-len(text) // _REPLAY_BLOCK) + 1, all_writes
    assert max(all_writes) >= _REPLAY_BLOCK
    assert len(sparse_writes) >= chunks // _REPLAY_BLOCK_TURNS, (sparse_writes, chunks)


async def test_a_replay_lagged_while_it_waits_for_its_reader_names_the_first_seq_not_sent(
    host: SysRoot, tmp_path: Path
) -> None:
    """A replaying client that stops reading while live events pour in is lagged when what
    is held for it overflows, mid-wait: its `lagged` line must name the first seq it was
    not sent, not one past the block that was waiting to go out (which it never got)."""
    log = tmp_path / "events.jsonl"
    line = ('{"seq":%d,"time":"2026-01-01T00:00:00.000000Z","type":"driver-changed",'
            '"addr":"0000:01:00.0","old":"nvidia","new":"vfio-pci","pad":"%s"}\n')
    total = 4000  # ~1.3 MiB: far more than the socket buffers and half the output limit
    log.write_text("".join(line % (seq, "x" * 200) for seq in range(1, total + 1)))
    with short_socket_dir() as sockdir:
        path = f"{sockdir}/gw.sock"
        async with served_watcher(host.root, path, log=str(log), outbox_limit=64 << 10,
                                  stall_timeout=30) as served:
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect(path)
            with client:
                client.sendall(P.encode_request(1, "subscribe", {"since_seq": 0}))
                conn = None
                with anyio.fail_after(10):
                    while conn is None or conn.buffered() <= (64 << 10) // 2:
                        await anyio.sleep(0.01)  # the replay now waits for its reader
                        conn = next(iter(served.server._replays), None)
                source = served.source
                assert isinstance(source, MemorySource)
                with anyio.fail_after(20):
                    while not conn.closed:  # live events held for it until they overflow
                        for action in ("unbind", "bind"):
                            before = served.watcher.seq
                            if action == "unbind":
                                host.unbind(NV)
                            else:
                                host.bind(NV, "nvidia")
                            source.push(host.uevent_props(action, NV))
                            while served.watcher.seq == before:
                                await anyio.sleep(0.002)
                client.setblocking(False)
                data = b""
                with anyio.fail_after(20):  # the daemon closes once its output is taken
                    while True:
                        await anyio.wait_readable(client)
                        chunk = client.recv(1 << 20)
                        if not chunk:
                            break
                        data += chunk
    lines = [P.loads(raw) for raw in data.splitlines()[1:]]  # after the subscribe reply
    events, lagged = lines[:-1], lines[-1]
    assert lagged["type"] == "lagged", lagged
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert lagged["first_missed_seq"] == len(events) + 1, (lagged, len(events))


@pytest.mark.parametrize("outbox_limit", [8 << 10, 40 << 10, 200 << 10])
async def test_a_replay_under_a_small_output_limit_still_reaches_a_reader_whole(
    host: SysRoot, tmp_path: Path, outbox_limit: int
) -> None:
    """A block never outgrows what the client's output limit leaves room for: a reader that
    keeps reading gets the whole replay, however small the limit, and no `lagged` line."""
    log = tmp_path / "events.jsonl"
    line = ('{"seq":%d,"time":"2026-01-01T00:00:00.000000Z","type":"driver-changed",'
            '"addr":"0000:01:00.0","old":"nvidia","new":"vfio-pci"}\n')
    total = 3000
    text = "".join(line % seq for seq in range(1, total + 1))
    log.write_text(text)
    with short_socket_dir() as sockdir:
        path = f"{sockdir}/gw.sock"
        async with served_watcher(host.root, path, log=str(log), outbox_limit=outbox_limit), \
                await anyio.connect_unix(path) as stream:
            await stream.send(P.encode_request(1, "subscribe", {"since_seq": 0}))
            got = await read_until_seq(stream, total)
    assert b'"lagged"' not in got
    assert got.partition(b"\n")[2].startswith(text.encode())


@pytest.mark.parametrize("outbox_limit", [2048, 8 << 10, 40 << 10, 4 << 20])
async def test_a_block_always_fits_the_room_a_paced_write_has(outbox_limit: int) -> None:
    """`paced` queues once at most half the limit is unread, and a subscriber's queue keeps
    `_LAG_RESERVE` bytes for its `lagged` line: every block must fit in what is left, or a
    reader that keeps up is lagged for a block the replay made too big."""

    class Recording:
        def __init__(self) -> None:
            self.last_seq = 0
            self.writes: list[tuple[int, int, int]] = []  # (first seq, bytes, last_seq then)

        async def paced(self, data: bytes, first_seq: int) -> None:
            self.writes.append((first_seq, len(data), self.last_seq))

    conn = Recording()
    block = _ReplayBlock(conn, outbox_limit)  # type: ignore[arg-type]
    seq = 0
    for size in [300, 4096, 4200, 100, 0, 4096] * 40:
        first = seq + 1
        seq += 3
        await block.add(RawChunk(first, seq, b"x" * (size - 1) + b"\n" if size else b""))
    await block.send()
    room = outbox_limit // 2 - _LAG_RESERVE
    assert all(size <= max(room, 4200) for _, size, _ in conn.writes), conn.writes[:5]
    assert all(size <= room for _, size, _ in conn.writes if room >= 4200)
    assert conn.last_seq == seq
    # While a block waits to be queued, ``last_seq`` still names what was sent before it.
    assert all(before < first for first, _, before in conn.writes), conn.writes[:5]
    assert [before for _, _, before in conn.writes] == sorted(b for _, _, b in conn.writes)
