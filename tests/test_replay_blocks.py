"""The socket replay writes its 4 KiB chunks in blocks (one wake-up of a fast reader per
block, not per chunk), never bigger than the room a reader that keeps up has, and moves a
client's ``last_seq`` past a block only once it is queued, so that a `lagged` line never
skips what was waiting to go out. Real sockets, an in-process daemon, no timings.
"""

from __future__ import annotations

import socket
from itertools import pairwise
from pathlib import Path
from typing import Any

import anyio
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
from gpuwatch.testing import SysRoot
from gpuwatch.watch.eventlog import _REPLAY_CHUNK, RawChunk

NV = "0000:01:00.0"


async def read_until_seq(stream: Any, seq: int) -> bytes:
    """What ``stream`` sends up to and including the whole line of event ``seq``."""
    got = b""
    needle = b'"seq":%d,' % seq
    with anyio.fail_after(20):
        while needle not in got or b"\n" not in got[got.index(needle):]:
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
            self.writes: list[tuple[int, int, int]] = []  # (first seq, last seq, bytes)

        async def paced(self, data: bytes, first_seq: int, last_seq: int) -> None:
            self.writes.append((first_seq, last_seq, len(data)))

    conn = Recording()
    block = _ReplayBlock(conn, outbox_limit)  # type: ignore[arg-type]
    seq = 0
    for size in [300, 4096, 4200, 100, 0, 4096] * 40:
        first = seq + 1
        seq += 3
        await block.add(RawChunk(first, seq, b"x" * (size - 1) + b"\n" if size else b""))
    await block.send()
    room = outbox_limit // 2 - _LAG_RESERVE
    sizes = [size for _, _, size in conn.writes]
    assert all(size <= max(room, 4200) for size in sizes), conn.writes[:5]
    assert all(size <= room for size in sizes if room >= 4200)
    # Every seq read is handed on once, in order, each block naming the seqs it covers.
    assert conn.writes[0][0] == 1 and conn.writes[-1][1] == seq
    assert all(last >= first for first, last, _ in conn.writes)
    assert all(nxt[0] > prev[1] for prev, nxt in pairwise(conn.writes))
