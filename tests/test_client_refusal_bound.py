"""A client whose request cannot be sent looks for the daemon's refusal among what is queued,
and reads no more than a refusal could take: a peer that stopped reading but keeps a flood
queued (or keeps sending) is not read on from until it stops.

Real unix sockets: the "daemon" shuts its read side, so the client's send fails (EPIPE), with
megabytes of lines waiting in the client's receive queue. What the client left unread is
measured on the daemon's side (SIOCOUTQ: bytes sent that the peer has not read).
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from gpuwatch.service.client import AsyncClient, Client, DaemonUnavailable
from gpuwatch.service.testing import short_socket_dir

pytestmark = pytest.mark.timeout(60)

FLOOD = 2 << 20  # bytes of stray lines queued for the client
# What a refusal could take (64 KiB), with room for the kernel's per-buffer accounting that
# SIOCOUTQ counts too: the unbounded client read the whole flood.
READ_AT_MOST = 128 << 10


@pytest.fixture
def listener() -> Iterator[tuple[str, socket.socket]]:
    with short_socket_dir() as where:
        path = str(Path(where) / "d.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        sock.listen(4)
        sock.settimeout(10)
        try:
            yield path, sock
        finally:
            sock.close()


def _flood_and_stop_reading(listener: socket.socket) -> socket.socket:
    """Accept, queue `FLOOD` bytes of lines that are no refusal, and shut the read side."""
    conn, _ = listener.accept()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 * FLOOD)
    conn.setblocking(False)
    line = b'{"id":7,"result":"not yours"}\n'
    sent = 0
    while sent < FLOOD:
        try:
            sent += conn.send(line * 1024)
        except BlockingIOError:
            break
    conn.shutdown(socket.SHUT_RD)
    return conn


def _unread(conn: socket.socket) -> int:
    out = fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
    return int(struct.unpack("i", out)[0])


def test_the_blocking_client_reads_a_bounded_part_of_a_flood(
        listener: tuple[str, socket.socket]) -> None:
    path, sock = listener
    client = Client(path, timeout=5)
    conn = _flood_and_stop_reading(sock)
    queued = _unread(conn)
    assert queued > 1 << 20  # the flood really is waiting
    try:
        with pytest.raises(DaemonUnavailable, match="broke"):
            client.call("probe", {"action": "detect-vfio"})
        left = _unread(conn)
        assert queued - left <= READ_AT_MOST, "the client read on past what a refusal could be"
    finally:
        client.close()
        conn.close()


def test_the_async_client_reads_a_bounded_part_of_a_flood(
        listener: tuple[str, socket.socket]) -> None:
    path, sock = listener

    async def main() -> tuple[int, int]:
        client = await AsyncClient.connect(path, timeout=5)
        conn = await anyio.to_thread.run_sync(_flood_and_stop_reading, sock)
        queued = _unread(conn)
        try:
            with pytest.raises(DaemonUnavailable, match="broke"):
                await client.call("probe", {"action": "detect-vfio"})
            return queued, _unread(conn)
        finally:
            await client.aclose()
            conn.close()

    queued, left = anyio.run(main)
    assert queued > 1 << 20
    assert queued - left <= READ_AT_MOST, "the client read on past what a refusal could be"
