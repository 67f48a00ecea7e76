"""A daemon that stops reading (stopped, hung, swamped) cannot hold a client's call past its
timeout: sending the request counts against the timeout as much as waiting for the reply.

Real unix sockets: a thread plays the daemon. It answers the first request, then reads
nothing until told to, so the client's requests pile up in the socket until a send cannot go
on. A request cut off part-way would fuse with the next one into garbage: the connection
then takes no more requests and says why; one that timed out before a byte went out leaves
the connection as good as it was.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from test_embedding import BACKENDS

from gpuwatch.service.client import AsyncClient, Client, DaemonUnavailable
from gpuwatch.service.testing import short_socket_dir

pytestmark = pytest.mark.timeout(60)

#: More than the socket's buffers hold together: its send stops part-way.
HUGE = 8 << 20
TIMEOUT = 0.5
#: What a call may take beyond its timeout here (a loaded test machine).
SLACK = 3.0


class StalledDaemon:
    """Answers the first request of a connection, then reads nothing until `drain`, and
    from then on answers every request by its id."""

    def __init__(self, path: str) -> None:
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(4)
        self._listener.settimeout(10)
        self._draining = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def drain(self) -> None:
        self._draining.set()

    def _serve(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        with conn, conn.makefile("rb") as lines:
            self._answer(conn, lines.readline())
            if not self._draining.wait(20):
                return
            for line in lines:
                if self._stop.is_set():
                    return
                self._answer(conn, line)

    @staticmethod
    def _answer(conn: socket.socket, line: bytes) -> None:
        rid = json.loads(line)["id"]
        conn.sendall(json.dumps({"id": rid, "result": f"answer {rid}"}).encode() + b"\n")

    def close(self) -> None:
        self._stop.set()
        self._draining.set()
        self._listener.close()
        self._thread.join(10)


@pytest.fixture
def daemon() -> Iterator[tuple[str, StalledDaemon]]:
    with short_socket_dir() as where:
        path = str(Path(where) / "d.sock")
        stalled = StalledDaemon(path)
        try:
            yield path, stalled
        finally:
            stalled.close()


def fill(sock: socket.socket) -> None:
    """Queue whole request lines until the socket takes no more (a small send on a unix
    stream socket goes whole or not at all): the next request cannot get a byte out."""
    sock.setblocking(False)
    try:
        while True:
            sock.send(b'{"id":0,"method":"snapshot"}\n')
    except BlockingIOError:
        pass


def test_a_blocking_call_gives_up_sending_at_its_timeout(
        daemon: tuple[str, StalledDaemon]) -> None:
    path, _stalled = daemon
    with Client(path, timeout=TIMEOUT) as c:
        # A call that may wait as long as it takes (a recover) leaves no unbounded socket
        # behind for the next call's send.
        assert c.call("probe", {"action": "detect-gpu"}, timeout=None) == "answer 1"
        began = time.monotonic()
        with pytest.raises(TimeoutError, match="took no request in time"):
            c.call("probe", {"action": "x" * HUGE})
        assert time.monotonic() - began < TIMEOUT + SLACK
        # Part of that request went out: the connection is done with, and says why.
        with pytest.raises(DaemonUnavailable, match="part-way"):
            c.probe("detect-gpu")


def test_a_blocking_call_that_sent_nothing_leaves_the_connection_usable(
        daemon: tuple[str, StalledDaemon]) -> None:
    path, stalled = daemon
    with Client(path, timeout=TIMEOUT) as c:
        assert c.probe("detect-gpu") == "answer 1"
        fill(c._sock)
        with pytest.raises(TimeoutError, match="took no request in time"):
            c.probe("detect-gpu")
        stalled.drain()
        assert c.probe("detect-gpu") == "answer 3"  # 2 never went out


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_async_call_gives_up_sending_at_its_timeout(
        daemon: tuple[str, StalledDaemon], backend: str) -> None:
    path, _stalled = daemon

    async def main() -> None:
        async with await AsyncClient.connect(path, timeout=TIMEOUT) as c:
            assert await c.probe("detect-gpu") == "answer 1"
            with anyio.move_on_after(TIMEOUT + SLACK) as outer:
                with pytest.raises(TimeoutError, match="no reply"):
                    await c.call("probe", {"action": "x" * HUGE})
            assert not outer.cancelled_caught, "the call waited past its timeout"
            with pytest.raises(DaemonUnavailable, match="part-way"):
                await c.probe("detect-gpu")

    anyio.run(main, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_async_call_that_sent_nothing_leaves_the_connection_usable(
        daemon: tuple[str, StalledDaemon], backend: str) -> None:
    path, stalled = daemon

    async def main() -> None:
        async with await AsyncClient.connect(path, timeout=TIMEOUT) as c:
            assert await c.probe("detect-gpu") == "answer 1"
            fill(c._stream.extra(anyio.abc.SocketAttribute.raw_socket))
            with anyio.move_on_after(TIMEOUT + SLACK) as outer:
                with pytest.raises(TimeoutError):
                    await c.probe("detect-gpu")
            assert not outer.cancelled_caught, "the call waited past its timeout"
            # The caller's own cancel before a byte went out breaks nothing either.
            with anyio.move_on_after(0.05):
                await c.call("probe", {"action": "detect-gpu"}, timeout=None)
            stalled.drain()
            assert await c.probe("detect-gpu") == "answer 4"  # 2 and 3 never went out

    anyio.run(main, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_events_take_a_timeout_like_the_blocking_clients(
        daemon: tuple[str, StalledDaemon], backend: str) -> None:
    path, _stalled = daemon

    async def main() -> None:
        async with await AsyncClient.connect(path, timeout=TIMEOUT) as c:
            await c.subscribe()  # answered; then nothing more comes
            with anyio.move_on_after(TIMEOUT + SLACK) as outer:
                with pytest.raises(TimeoutError, match="no event"):
                    await c.events(timeout=TIMEOUT).__anext__()
            assert not outer.cancelled_caught

    anyio.run(main, backend=backend)
