"""`end_turn`: a request that arrives during one turn of a task's work is answered before the
next turn, on the event loop the daemon runs (asyncio), with a real socket's readiness; and so
on the daemon's socket during a history replay and during a backlog of uevents.

No timings: the assertions are about the order in which the loop runs things.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from gpuwatch.service import protocol as P
from gpuwatch.service.server import Connection
from gpuwatch.service.testing import served_watcher, short_socket_dir
from gpuwatch.sources.memory import MemorySource
from gpuwatch.sources.turns import end_turn
from gpuwatch.testing import SysRoot
from gpuwatch.watch.watcher import PUMP_SLICE


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


def _write_log(log: Path, count: int) -> None:
    """An event log of ``count`` ``driver-changed`` lines, seqs 1 to ``count``."""
    line = ('{"seq":%d,"time":"2026-01-01T00:00:00.000000Z","type":"driver-changed",'
            '"addr":"0000:01:00.0","old":"nvidia","new":"vfio-pci"}\n')
    log.write_text("".join(line % seq for seq in range(1, count + 1)))


def probe_client(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return sock


PROBE = P.encode_request(7, "probe", {"action": "detect-gpu"})


async def test_a_probe_sent_during_a_replay_turn_is_answered_before_the_next(
    host: SysRoot, tmp_path: Path
) -> None:
    log = tmp_path / "events.jsonl"
    _write_log(log, 300)  # ~40 KiB: ten turns
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


def replies_waiting(sock: socket.socket) -> int:
    """How many whole replies have arrived on ``sock`` (without taking them)."""
    try:
        return sock.recv(1 << 20, socket.MSG_PEEK | socket.MSG_DONTWAIT).count(b"\n")
    except BlockingIOError:
        return 0


async def test_a_probe_sent_in_the_turn_that_fills_a_replay_block_is_answered_before_its_write(
    host: SysRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writing a block of the replay (64 KiB handed to the kernel, the reader woken) is a
    turn of its own: a probe that came in while the chunk that filled the block was read
    is answered before the block is written. Was: the write ran in the same turn as that
    read, the longest step of a replay, and the probe waited for both."""
    log = tmp_path / "events.jsonl"
    _write_log(log, 1500)  # ~190 KiB: three blocks
    sent = 0  # probes sent, one during each turn's read after the first
    behind: list[int] = []  # per block written: probes sent and not answered yet
    with short_socket_dir() as sockdir:
        path = f"{sockdir}/gw.sock"
        async with served_watcher(host.root, path, log=str(log)) as served:
            prober = probe_client(path)
            history = served.server._history

            def watched_history(since_seq: int, sub: Any) -> Iterator[Any]:
                nonlocal sent
                for index, chunk in enumerate(history(since_seq, sub)):
                    if index:  # the first is read in a thread, before the reply
                        prober.sendall(PROBE)  # arrives while this turn works
                        sent += 1
                    yield chunk

            deliver = Connection.deliver

            def watched_deliver(self: Connection, data: bytes, first_seq: int,
                                count: int) -> None:
                if self.sub is not None and count > 1:  # a block of the replay
                    behind.append(sent - replies_waiting(prober))
                deliver(self, data, first_seq, count)

            served.server._history = watched_history  # type: ignore[method-assign]
            monkeypatch.setattr(Connection, "deliver", watched_deliver)
            with prober, probe_client(path) as replayer:
                replayer.sendall(P.encode_request(1, "subscribe", {"since_seq": 0}))
                got = b""
                with anyio.fail_after(10):
                    while b'"seq":1500,' not in got[-4096:]:
                        await anyio.sleep(0.002)
                        with contextlib.suppress(BlockingIOError):
                            got += replayer.recv(1 << 20, socket.MSG_DONTWAIT)
    assert len(behind) >= 3, behind
    assert behind == [0] * len(behind), behind


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
