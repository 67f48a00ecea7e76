"""The socket API against a running watcher on a fixture root: every method, bad clients,
slow readers, many clients, reconnecting with ``since_seq``, and the CLI asking the daemon."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import resource
import socket
import stat
import threading
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from cli_helpers import run_cli
from test_embedding import BACKENDS

from gpuwatch.cli.daemon import DaemonLost, ask_daemon
from gpuwatch.core.events import NodeAdded, ProbeChanged
from gpuwatch.errors import (
    DeviceNotFound,
    GroupBusy,
    GroupPoisoned,
    NotPrivileged,
    SwitchFailed,
    SwitchRefused,
    SwitchWedged,
    UsageError,
)
from gpuwatch.jsonout import jsonable
from gpuwatch.model import ACTIONS, holders_report, plan_for_host
from gpuwatch.service import protocol as P
from gpuwatch.service.client import (
    AsyncClient,
    Client,
    DaemonDeviceNotFound,
    DaemonError,
    DaemonUsageError,
    try_daemon,
)
from gpuwatch.service.ops import default_ops
from gpuwatch.service.peers import PeerCred
from gpuwatch.service.server import SocketInUse, SocketServer, SocketSetupError, bind_socket
from gpuwatch.service.testing import ServedWatcher, served_watcher, short_socket_dir
from gpuwatch.sources.memory import MemorySource
from gpuwatch.switch.engine import SwitchResult
from gpuwatch.testing import SysRoot
from gpuwatch.watch.eventlog import EventLog

NV, NV_AUDIO, IGPU, NIC = "0000:01:00.0", "0000:01:00.1", "0000:00:02.0", "0000:02:00.0"


@pytest.fixture
def sockdir() -> Iterator[str]:
    with short_socket_dir() as path:
        yield path


class Raw:
    """A bare protocol client: bytes out, JSON lines in (what a shell or Go client sees)."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.buf = b""

    @classmethod
    async def connect(cls, path: str) -> Raw:
        return cls(await anyio.connect_unix(path))

    async def send(self, data: bytes) -> None:
        await self.stream.send(data)

    async def line(self, timeout: float = 5) -> Any:
        with anyio.fail_after(timeout):
            while b"\n" not in self.buf:
                self.buf += await self.stream.receive()
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line)

    async def request(self, method: str, params: dict[str, Any] | None = None, rid: Any = 1) -> Any:
        await self.send(P.encode_request(rid, method, params))
        return await self.line()

    async def eof(self, timeout: float = 5) -> bytes:
        """Everything left until the server closes."""
        rest = self.buf
        with anyio.fail_after(timeout):
            try:
                while True:
                    rest += await self.stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
                pass
        return rest

    async def aclose(self) -> None:
        await self.stream.aclose()


@asynccontextmanager
async def daemon(
    host: SysRoot, sockdir: str, tmp_path: Path, **kw: Any
) -> AsyncIterator[ServedWatcher]:
    log = kw.pop("log", str(tmp_path / "events.jsonl"))
    async with served_watcher(host.root, f"{sockdir}/gw.sock", log=log, **kw) as served:
        yield served


async def settle(served: ServedWatcher, seq: int) -> None:
    with anyio.fail_after(5):
        while served.watcher.seq < seq:
            await anyio.sleep(0.005)


async def toggle(served: ServedWatcher, host: SysRoot, addr: str, driver: str) -> None:
    """Unbind or rebind ``addr`` in the tree and send its uevent; wait until it is applied."""
    before = served.watcher.seq
    source = served.source
    assert isinstance(source, MemorySource)
    if (host.device_dir(addr) / "driver").is_symlink():
        host.unbind(addr)
        source.push(host.uevent_props("unbind", addr))
    else:
        host.bind(addr, driver)
        source.push(host.uevent_props("bind", addr))
    await settle(served, before + 1)
    await anyio.sleep(0.01)  # the probe-changed that may follow in the same batch


# --------------------------------------------------------------------------- methods


async def test_every_probe_action_answers_like_the_model(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    params = {"group": 13, "addr": NV, "mode": "nvidia"}
    async with daemon(host, sockdir, tmp_path) as served:
        c = await Raw.connect(served.path)
        for n, action in enumerate(ACTIONS):
            kw = {k: params[k] for k in ACTIONS[action]}
            if action == "plan":  # needs --addr or --vendor besides its mode
                kw.update(addr=NV, mode="vfio")
            reply = await c.request("probe", {"action": action, **kw}, rid=n)
            assert reply["id"] == n and "error" not in reply, reply
            if action == "memlock":  # answered for the peer: that is us
                soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
                unlimited = resource.RLIM_INFINITY
                assert reply["result"] == {
                    "soft": None if soft == unlimited else soft,
                    "hard": None if hard == unlimited else hard,
                }
            else:
                assert reply["result"] == jsonable(served.watcher.model.probe(action, **kw)), action
        await c.aclose()


async def test_names_with_bytes_that_are_not_utf8_are_answered_not_internal_errors(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    """A crafted tree names the GPU's driver with a byte that is not UTF-8 (Python holds it
    as a surrogate escape, which JSON cannot carry). Every answer that names it goes out
    with U+FFFD in its place, as the log writes it; it used to be an internal error for
    every client, every time (snapshot, detect-vfio, display-driver)."""
    link = host.root / "sys/bus/pci/devices" / NV / "driver"
    os.unlink(link)
    os.makedirs(bytes(host.root / "sys/bus/pci/drivers") + b"/nv\xffidia")
    os.symlink(b"../../../bus/pci/drivers/nv\xffidia", bytes(link))
    async with daemon(host, sockdir, tmp_path) as served:
        c = await Raw.connect(served.path)
        reply = await c.request("probe", {"action": "display-driver", "addr": NV})
        assert reply == {"id": 1, "result": "nv\ufffdidia"}
        reply = await c.request("probe", {"action": "detect-vfio"}, rid=2)
        assert [g["driver"] for g in reply["result"]["gpus"] if g["addr"] == NV] == [
            "nv\ufffdidia"]
        reply = await c.request("snapshot", {}, rid=3)
        assert reply["id"] == 3 and "nv\ufffdidia" in json.dumps(reply, ensure_ascii=False)
        await c.aclose()


@pytest.mark.parametrize(
    ("params", "code", "text"),
    [
        ({"action": "detect-everything"}, P.INVALID_PARAMS, "unknown action"),
        ({}, P.INVALID_PARAMS, "'action' is required"),
        ({"action": 5}, P.INVALID_PARAMS, "must be a string"),
        ({"action": "display-driver"}, P.INVALID_PARAMS, "needs --addr"),
        ({"action": "display-driver", "addr": "1:0.0"}, P.INVALID_PARAMS, "not a PCI address"),
        ({"action": "display-driver", "addr": "0000:0a:00.0"}, P.NOT_FOUND, "no PCI function"),
        ({"action": "vfio-group-accessible", "group": "13"}, P.INVALID_PARAMS, "an integer"),
        ({"action": "vfio-group-accessible", "group": True}, P.INVALID_PARAMS, "an integer"),
        (
            {"action": "group-in-mode", "addr": NV, "mode": "host"},
            P.INVALID_PARAMS,
            "vfio or nvidia",
        ),
        ({"action": "detect-gpu", "adr": NV}, P.INVALID_PARAMS, "unknown parameter 'adr'"),
    ],
)
async def test_probe_errors_are_replies_with_codes(
    host: SysRoot, sockdir: str, tmp_path: Path, params: dict[str, Any], code: str, text: str
) -> None:
    async with daemon(host, sockdir, tmp_path) as served:
        c = await Raw.connect(served.path)
        reply = await c.request("probe", params, rid="r1")
        assert reply == {"id": "r1", "error": {"code": code, "message": reply["error"]["message"]}}
        assert text in reply["error"]["message"]
        assert (await c.request("probe", {"action": "detect-gpu"}, rid=2))["result"] is True
        await c.aclose()


async def test_snapshot_is_the_watchers(host: SysRoot, sockdir: str, tmp_path: Path) -> None:
    async with daemon(host, sockdir, tmp_path) as served:
        await toggle(served, host, NIC, "igb")
        c = await Raw.connect(served.path)
        reply = await c.request("snapshot")
        assert reply["result"] == jsonable(served.watcher.snapshot())
        assert reply["result"]["seq"] == served.watcher.seq == 2
        assert {f["addr"]: f["driver"] for f in reply["result"]["functions"]}[NIC] == ""
        await c.aclose()


async def test_vfio_group_accessible_is_answered_for_the_peer(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    host.add_vfio_group(13, mode=0o600)
    async with daemon(host, sockdir, tmp_path) as served:
        c = await Raw.connect(served.path)
        assert (await c.request("probe", {"action": "vfio-group-accessible", "group": 13}))[
            "result"
        ]
        assert not (await c.request("probe", {"action": "vfio-group-accessible", "group": 7}))[
            "result"
        ]
        assert not (await c.request("probe", {"action": "vfio-group-accessible", "group": -1}))[
            "result"
        ]
        await c.aclose()


async def test_subscribe_streams_filtered_events(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    async with daemon(host, sockdir, tmp_path) as served:
        only_nic = await Raw.connect(served.path)
        everything = await Raw.connect(served.path)
        reply = await only_nic.request(
            "subscribe", {"types": ["driver-changed"], "addrs": [NIC.upper()]}
        )
        assert reply == {"id": 1, "result": {"seq": 1, "complete": True}}
        assert (await everything.request("subscribe"))["result"]["seq"] == 1
        # driver-changed + probe-changed detect-gpu, detect-vfio, detect-host-devices
        await toggle(served, host, NV, "nvidia")
        await toggle(served, host, NIC, "igb")
        got = await only_nic.line()
        assert (got["type"], got["addr"], got["old"], got["new"]) == (
            "driver-changed",
            NIC,
            "igb",
            "",
        )
        assert got["seq"] == served.watcher.seq
        seen = [await everything.line() for _ in range(served.watcher.seq - 1)]
        assert [e["seq"] for e in seen] == list(range(2, served.watcher.seq + 1))
        assert [e["type"] for e in seen] == ["driver-changed", *["probe-changed"] * 3,
                                             "driver-changed"]
        # A subscribed connection still answers requests, the reply told apart by its "id".
        assert (await only_nic.request("probe", {"action": "detect-gpu"}, rid=9)) == {
            "id": 9,
            "result": False,  # the only NVIDIA GPU left nvidia
        }
        again = await only_nic.request("subscribe", rid=10)
        assert again["error"]["code"] == P.ALREADY_SUBSCRIBED
        await only_nic.aclose()
        await everything.aclose()


async def test_subscribe_rejects_bad_filters(host: SysRoot, sockdir: str, tmp_path: Path) -> None:
    async with daemon(host, sockdir, tmp_path) as served:
        c = await Raw.connect(served.path)
        for params, text in (
            ({"types": ["driver-change"]}, "unknown event type"),
            ({"types": "driver-changed"}, "a list of strings"),
            ({"since_seq": -1}, ">= 0"),
            ({"since_seq": 1.5}, "an integer"),
            ({"addrs": ["01:00.0"]}, "not a PCI address"),
        ):
            reply = await c.request("subscribe", params)
            assert reply["error"]["code"] == P.INVALID_PARAMS and text in reply["error"]["message"]
        await c.aclose()


async def test_subscribe_addrs_are_read_like_every_addr(host: SysRoot, sockdir: str,
                                                        tmp_path: Path) -> None:
    async with daemon(host, sockdir, tmp_path) as served:
        padded = await Raw.connect(served.path)
        reply = await padded.request("subscribe", {"addrs": ["00000000:02:00.0"]})
        assert reply["result"]["seq"] == 1
        await toggle(served, host, NIC, "igb")
        got = await padded.line()
        assert (got["type"], got["addr"]) == ("driver-changed", NIC)
        await padded.aclose()


async def test_reconnect_with_since_seq_misses_nothing_and_repeats_nothing(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    async with daemon(host, sockdir, tmp_path) as served:
        c = await Raw.connect(served.path)
        await c.request("subscribe")
        await toggle(served, host, NIC, "igb")
        first = await c.line()
        await c.aclose()  # the client goes away ...
        await toggle(served, host, NIC, "igb")  # ... and misses these
        await toggle(served, host, NV, "nvidia")
        missed_until = served.watcher.seq
        c = await Raw.connect(served.path)
        reply = await c.request("subscribe", {"since_seq": first["seq"]})
        assert reply["result"] == {"seq": missed_until, "complete": True}
        await toggle(served, host, NV, "nvidia")  # live, after the reconnect
        got = [await c.line() for _ in range(served.watcher.seq - first["seq"])]
        assert [e["seq"] for e in got] == list(range(first["seq"] + 1, served.watcher.seq + 1))
        log_lines = (tmp_path / "events.jsonl").read_text().splitlines()
        assert [json.loads(x) for x in log_lines[first["seq"] :]] == got  # byte-for-byte the log
        with pytest.raises(TimeoutError):
            await c.line(timeout=0.2)  # and nothing twice
        await c.aclose()


async def test_since_seq_while_events_keep_coming_is_gapless(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    """Events published during the history replay are held, then sent once, in order; a
    filtered subscriber gets exactly its kind, also across the seam."""
    pad = "x" * 2000
    async with daemon(host, sockdir, tmp_path) as served:
        w = served.watcher
        for i in range(300):  # a history worth replaying (about 1.2 MB), two kinds of event
            w.publish([ProbeChanged(action="detect-gpu", old=pad, new=pad)])
            if i % 3 == 0:
                w.publish([NodeAdded(path=f"/dev/vfio/{i}")])
        everything = await Raw.connect(served.path)
        nodes = await Raw.connect(served.path)
        async with anyio.create_task_group() as tg:

            async def keep_publishing() -> None:
                for i in range(200):
                    w.publish([ProbeChanged(action="detect-gpu", old=1, new=2)])
                    if i % 3 == 0:
                        w.publish([NodeAdded(path=f"/dev/vfio/{1000 + i}")])
                    await anyio.sleep(0)

            await everything.send(P.encode_request(1, "subscribe", {"since_seq": 5}))
            await nodes.send(
                P.encode_request(1, "subscribe", {"since_seq": 5, "types": ["node-added"]})
            )
            tg.start_soon(keep_publishing)
            assert (await everything.line())["result"]["complete"] is True
            assert (await nodes.line())["result"]["complete"] is True
            total = 1 + 300 + 100 + 200 + 67
            seqs: list[int] = []
            while len(seqs) < total - 5:
                seqs.append((await everything.line())["seq"])
            node_events = [
                e
                for e in map(json.loads, (tmp_path / "events.jsonl").read_text().splitlines())
                if e["type"] == "node-added" and e["seq"] > 5
            ]
            got = [(await nodes.line())["seq"] for _ in node_events]
        assert w.seq == total
        assert seqs == list(range(6, total + 1))
        assert got == [e["seq"] for e in node_events] and len(got) == 99 + 67
        with pytest.raises(TimeoutError):
            await nodes.line(timeout=0.2)
        await everything.aclose()
        await nodes.aclose()


async def test_lost_history_is_reported_incomplete(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    log = EventLog(tmp_path / "small.jsonl", max_bytes=400, keep=1)
    async with daemon(host, sockdir, tmp_path, log=log) as served:
        for _ in range(6):
            await toggle(served, host, NIC, "igb")
        c = await Raw.connect(served.path)
        reply = await c.request("subscribe", {"since_seq": 1})  # rotated away since
        assert reply["result"] == {"seq": served.watcher.seq, "complete": False}
        await c.aclose()
        c = await Raw.connect(served.path)
        reply = await c.request("subscribe", {"since_seq": 10_000})  # a seq of another log
        assert reply["result"] == {"seq": served.watcher.seq, "complete": False}
        await toggle(served, host, NIC, "igb")
        assert (await c.line())["seq"] == served.watcher.seq  # streams live all the same
        await c.aclose()
    log.close()
    async with daemon(host, sockdir, tmp_path, log=None) as served:  # no log: no history
        await toggle(served, host, NIC, "igb")
        c = await Raw.connect(served.path)
        assert (await c.request("subscribe", {"since_seq": 0}))["result"]["complete"] is False
        await c.aclose()


# --------------------------------------------------------------------------- bad clients


async def test_garbage_gets_error_replies_and_the_connection_survives(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    cases = [
        (b"not json", None, P.PARSE_ERROR),
        (b"\xff\xfe\x00garbage", None, P.PARSE_ERROR),
        (b"[1, 2]", None, P.INVALID_REQUEST),
        (b'{"id": 7}', 7, P.INVALID_REQUEST),
        (b'{"id": 8, "method": 3}', 8, P.INVALID_REQUEST),
        (b'{"id": "x", "method": "nope"}', "x", P.UNKNOWN_METHOD),
        (b'{"id": 9, "method": "probe", "params": [1]}', 9, P.INVALID_PARAMS),
        (b'{"id": 10, "method": "snapshot", "params": {"x": 1}}', 10, P.INVALID_PARAMS),
        (b'{"id": 11, "method": "probe", "extra": 1}', 11, P.INVALID_REQUEST),
        # bad-request takes no value of the line, its id neither (docs/socket.md, `id`).
        (b'{"id": 12, "method": "probe", "params": {"group": 1e400}}', None, P.BAD_REQUEST),
        (b'{"id": 13, "id": 14, "method": "snapshot"}', None, P.BAD_REQUEST),
    ]
    async with daemon(host, sockdir, tmp_path) as served:
        c = await Raw.connect(served.path)
        await c.send(b"\n   \n")  # blank lines are spacing, not requests
        for line, rid, code in cases:
            await c.send(line + b"\n")
            reply = await c.line()
            assert reply["id"] == rid and reply["error"]["code"] == code, (line, reply)
            assert "\n" not in reply["error"]["message"]
        reply = await c.request("probe", {"action": "current-mode", "addr": NV}, rid=None)
        assert reply == {"id": None, "result": "nvidia"}
        # `params` null, and a parameter null, are as not given.
        await c.send(b'{"id": 15, "method": "snapshot", "params": null}\n')
        assert (await c.line())["result"]["seq"] == 1
        await c.send(b'{"id": 16, "method": "probe", "params": {"action": "current-mode", '
                     b'"addr": "0000:01:00.0", "vendor": null, "group": null}}\n')
        assert await c.line() == {"id": 16, "result": "nvidia"}
        await c.aclose()


async def test_oversized_line_is_refused_without_buffering_it(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    async with daemon(host, sockdir, tmp_path) as served:
        c = await Raw.connect(served.path)
        big = b'{"id": 1, "method": "probe", "params": {"action": "' + b"a" * (3 << 20)

        async def push() -> None:
            with pytest.raises((anyio.BrokenResourceError, BrokenPipeError, ConnectionResetError)):
                await c.send(big + b'"}}\n')

        async with anyio.create_task_group() as tg:
            tg.start_soon(push)
            first = await c.line()
            assert await c.eof() == b""  # and then the connection is closed
        await c.aclose()
        assert first["id"] is None and first["error"]["code"] == P.REQUEST_TOO_LARGE
        assert "65536" in first["error"]["message"]
        # A line of exactly the limit (newline not counted) is a request like any other.
        c = await Raw.connect(served.path)
        head = b'{"id": 3, "method": "probe", "params": {"action": "detect-gpu", "addr": "'
        exact = head + b"x" * (P.MAX_LINE - len(head) - 3) + b'"}}'
        assert len(exact) == P.MAX_LINE
        await c.send(exact + b"\n")
        assert (await c.line())["error"]["code"] == P.INVALID_PARAMS  # read, parsed, answered
        assert (await c.request("snapshot", rid=4))["id"] == 4
        await c.send(exact + b"y\n")
        assert (await c.line())["error"]["code"] == P.REQUEST_TOO_LARGE
        assert await c.eof() == b""
        await c.aclose()


async def test_slow_reader_is_disconnected_and_holds_up_no_one(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    pad = "y" * 8000
    async with daemon(host, sockdir, tmp_path, outbox_limit=256 << 10) as served:
        w = served.watcher
        stalled = await Raw.connect(served.path)
        reader = await Raw.connect(served.path)
        await stalled.request("subscribe")
        await reader.request("subscribe")
        received: list[int] = []
        count = 400  # 3+ MB: far past the kernel's socket buffer and the outbox limit
        async with anyio.create_task_group() as tg:

            async def read_all() -> None:
                while len(received) < count:
                    received.append((await reader.line())["seq"])

            tg.start_soon(read_all)
            with anyio.fail_after(20):
                for _ in range(count):
                    w.publish([ProbeChanged(action="detect-gpu", old=pad, new=pad)])
                    await anyio.sleep(0)
        assert received == list(range(2, count + 2))  # the reader lost nothing
        assert served.server.lag_drops == 1
        rest = await stalled.eof()  # what the kernel held, then the end
        assert len(rest) < 1 << 20
        assert len(served.server.connections) == 1
        await stalled.aclose()
        await reader.aclose()


async def test_a_client_that_never_reads_replies_is_dropped(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    """Its requests wait while half its output is unread (reading stops too, so what it
    sends stays in the kernel), and after the stall timeout it is closed."""
    async with daemon(host, sockdir, tmp_path, outbox_limit=64 << 10,
                      stall_timeout=0.5) as served:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.connect(served.path)
        request = P.encode_request(1, "snapshot")
        with anyio.fail_after(20):
            while True:  # keep asking, never read: the daemon must cut us off
                try:
                    sock.send(request * 20)
                except BlockingIOError:
                    await anyio.sleep(0.01)
                except (BrokenPipeError, ConnectionResetError):
                    break
                if not served.server.connections:
                    break
                await anyio.sleep(0)
        sock.close()
        probe = await Raw.connect(served.path)  # the daemon is fine
        assert (await probe.request("probe", {"action": "detect-gpu"}))["result"] is True
        await probe.aclose()


async def test_a_client_that_asks_much_at_once_and_reads_gets_every_reply(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    """Sixty snapshots in one write, eight times the output limit together: they were
    answered in one turn until the unread replies passed the limit, and the client was cut
    off with none. Now each next answer waits until the client has read its replies down."""
    async with daemon(host, sockdir, tmp_path, outbox_limit=16 << 10) as served:
        c = await Raw.connect(served.path)
        snapshot = await c.request("snapshot", rid=0)
        size = len(json.dumps(snapshot))
        count = 60
        assert size * count > 8 * (16 << 10)
        await c.send(b"".join(P.encode_request(i, "snapshot") for i in range(1, count + 1)))
        replies = [await c.line() for _ in range(count)]
        assert [r["id"] for r in replies] == list(range(1, count + 1))
        assert all(r["result"] == snapshot["result"] for r in replies)
        assert (await c.request("probe", {"action": "detect-gpu"}))["result"] is True
        await c.aclose()


async def test_a_subscriber_that_asks_much_and_never_reads_gets_its_resume_point(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    """Its requests wait while half its output is unread; after the stall timeout it is cut
    off as a subscriber is: with the `lagged` line naming where to resume."""
    async with daemon(host, sockdir, tmp_path, outbox_limit=16 << 10,
                      stall_timeout=0.5) as served:
        c = await Raw.connect(served.path)
        assert (await c.request("subscribe"))["result"]["seq"] == 1
        await c.send(b"".join(P.encode_request(i, "snapshot") for i in range(1, 61)))
        with anyio.fail_after(10):
            while not served.server.lag_drops:
                await anyio.sleep(0.05)
        lines = [json.loads(line) for line in (await c.eof()).splitlines()]
        await c.aclose()
    answered = [x["id"] for x in lines if "id" in x]
    assert answered == list(range(1, len(answered) + 1)) and len(answered) < 60
    assert lines[-1] == {"type": "lagged", "missed": 0, "first_missed_seq": 2,
                         "resume_since_seq": 1, "outbox_limit": 16 << 10}


async def _read_to_eof(c: Raw, into: list[bytes]) -> None:
    into.append(await c.eof(timeout=20))


def _publish_driver_changes(served: ServedWatcher, count: int) -> None:
    from gpuwatch.core.events import driver_changed

    for first in range(0, count, 500):
        served.watcher.publish([driver_changed(NIC, "igb", "") if i % 2 else
                                driver_changed(NIC, "", "igb")
                                for i in range(first, min(first + 500, count))])


async def test_a_subscriber_that_reads_gets_every_event_and_stopped_before_the_close(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    """At a stop each connection was aborted: what the kernel had not taken yet was thrown
    away, so a subscriber reading on saw a line cut in half and no `stopped`. Each is now
    closed once it has what it was sent (at most 2 s for all together)."""
    count = 20_000  # ~2.4 MB: far more than a socket buffer holds, within the output limit
    got: list[bytes] = []
    # The reader outlives the daemon: its task group is entered first, left last.
    async with anyio.create_task_group() as tg, daemon(host, sockdir, tmp_path) as served:
        c = await Raw.connect(served.path)
        assert (await c.request("subscribe"))["result"]["seq"] == 1
        _publish_driver_changes(served, count)
        served.watcher.stop("signal SIGTERM")  # what the daemon publishes at a stop
        tg.start_soon(_read_to_eof, c, got)
    await c.aclose()
    lines = got[0].splitlines()
    assert got[0].endswith(b"\n")
    events = [json.loads(line) for line in lines]
    assert [e["seq"] for e in events] == list(range(2, count + 3))
    assert events[-1]["type"] == "stopped" and events[-1]["reason"] == "signal SIGTERM"


async def test_stopped_reaches_the_subscribers_whose_filter_takes_it(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    """docs/socket.md: a filter that leaves `stopped` out (a `types` without it, any `addrs`:
    it names no address) sees the end of file only; the others get it as their last line."""
    filters: list[dict[str, Any]] = [{}, {"types": ["stopped"]}, {"types": ["driver-changed"]},
                                     {"addrs": [NIC]}]
    got: list[list[bytes]] = [[] for _ in filters]
    async with anyio.create_task_group() as tg, daemon(host, sockdir, tmp_path) as served:
        clients = [await Raw.connect(served.path) for _ in filters]
        for c, params in zip(clients, filters, strict=True):
            assert (await c.request("subscribe", params))["result"]["complete"] is True
        _publish_driver_changes(served, 1)
        served.watcher.stop("signal SIGTERM")
        for c, into in zip(clients, got, strict=True):
            tg.start_soon(_read_to_eof, c, into)
    types = [[json.loads(line)["type"] for line in out[0].splitlines()] for out in got]
    assert types == [["driver-changed", "stopped"], ["stopped"], ["driver-changed"],
                     ["driver-changed"]]
    for c in clients:
        await c.aclose()


async def test_a_subscriber_still_replaying_at_the_stop_is_told_where_to_resume(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    """A stop during a subscriber's history replay dropped the requests queued behind its
    subscribe and the live events held meanwhile, with no word. Now the queued requests are
    answered, and the `lagged` line, last, names the first seq it was not sent."""
    got: list[bytes] = []
    async with anyio.create_task_group() as tg, daemon(
            host, sockdir, tmp_path, outbox_limit=64 << 10) as served:
        _publish_driver_changes(served, 5_000)  # into the log: ~600 KB to replay
        c = await Raw.connect(served.path)
        await c.send(P.encode_request("sub", "subscribe", {"since_seq": 0})
                     + P.encode_request("p", "probe", {"action": "detect-gpu"})
                     + b"not json\n")
        with anyio.fail_after(5):  # the replay waits for us to read
            while not served.server._replays:
                await anyio.sleep(0.01)
        await anyio.sleep(0.2)
        _publish_driver_changes(served, 10)  # live events, held behind the replay
        served.watcher.stop("signal SIGTERM")
        tg.start_soon(_read_to_eof, c, got)
    await c.aclose()
    lines = [json.loads(line) for line in got[0].splitlines()]
    assert lines[0] == {"id": "sub", "result": {"seq": 5_001, "complete": True}}
    events = [x for x in lines[1:] if "seq" in x]
    assert events and [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert len(events) < 5_001  # cut off mid-replay, as the test means
    rest = [x for x in lines[1:] if "seq" not in x]
    assert rest[0] == {"id": "p", "error": {"code": P.UNAVAILABLE,
                                            "message": "probe: the daemon is stopping; retry"}}
    assert rest[1]["error"]["code"] == P.PARSE_ERROR
    assert rest[2] == {"type": "lagged", "missed": 5_012 - len(events),
                       "first_missed_seq": len(events) + 1, "resume_since_seq": len(events),
                       "outbox_limit": 64 << 10}
    assert lines[-1] == rest[2]


async def test_hundreds_of_concurrent_clients(host: SysRoot, sockdir: str, tmp_path: Path) -> None:
    n = 200
    async with daemon(host, sockdir, tmp_path) as served:
        clients = [await AsyncClient.connect(served.path) for _ in range(n)]
        results: list[Any] = [None] * n
        async with anyio.create_task_group() as tg:

            async def use(i: int) -> None:
                c = clients[i]
                snap = await c.snapshot()
                mode = await c.probe("current-mode", addr=NV)
                await c.subscribe(types=["driver-changed"])
                results[i] = (snap["seq"], mode)

            for i in range(n):
                tg.start_soon(use, i)
        assert results == [(1, "nvidia")] * n
        assert len(served.server.connections) == n
        await toggle(served, host, NIC, "igb")
        async with anyio.create_task_group() as tg:
            events: list[Any] = []

            async def first_event(c: AsyncClient) -> None:
                async for event in c.events():
                    events.append(event)
                    return

            for c in clients:
                tg.start_soon(first_event, c)
        assert len(events) == n and {e["addr"] for e in events} == {NIC}
        for c in clients:
            await c.aclose()


async def test_half_closed_client_gets_its_replies(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    """What `echo '…' | socat - UNIX-CONNECT:…` does: send, shut the write side, read to EOF."""
    async with daemon(host, sockdir, tmp_path) as served:
        c = await Raw.connect(served.path)
        await c.send(
            P.encode_request(1, "probe", {"action": "detect-gpu"})
            + b'{"id": 2, "method": "probe", "params": {"action": "current-mode", "addr": "'
            + NV.encode()
            + b'"}}'
        )  # the last line without a newline still counts
        await c.stream.send_eof()
        lines = [json.loads(x) for x in (await c.eof()).splitlines()]
        assert lines == [{"id": 1, "result": True}, {"id": 2, "result": "nvidia"}]
        await c.aclose()


# --------------------------------------------------------------------------- the socket file


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: chown of the socket to a group "
                    "we are not in, and a root-owned socket file")
async def test_socket_file_mode_group_and_removal(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    path = f"{sockdir}/gw.sock"
    async with served_watcher(host.root, path, read_gid=4242) as served:
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
        assert (st.st_uid, st.st_gid) == (0, 4242)
        with pytest.raises(SocketInUse, match="another gpuwatch daemon"):
            bind_socket(path, None)  # a second daemon does not steal the socket
        assert served.server.connections == set()
    assert not os.path.exists(path)


def test_stale_socket_is_replaced_and_a_file_is_not(sockdir: str) -> None:
    path = f"{sockdir}/gw.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(path)
    dead.close()  # a daemon that died: the file stays, nobody answers
    sock = bind_socket(path, None)
    sock.close()
    os.unlink(path)
    Path(path).write_text("precious")
    with pytest.raises(SocketSetupError, match="not a socket"):
        bind_socket(path, None)
    assert Path(path).read_text() == "precious"


def test_a_socket_bound_first_by_another_daemon_is_not_removed(
    sockdir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two daemons starting at once: the one whose bind loses (EADDRINUSE) must leave the
    winner's socket in place, not remove it on its way out as if it were its own."""
    path = f"{sockdir}/gw.sock"
    winner = socket.socket(socket.AF_UNIX)
    real_lstat = os.lstat

    def look_then_lose_the_race(name: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if name == path and not winner.getsockname():
            winner.bind(path)  # the other daemon binds between our look and our bind
            winner.listen()
            raise FileNotFoundError(name)
        return real_lstat(name, *args, **kwargs)

    with winner:
        monkeypatch.setattr(os, "lstat", look_then_lose_the_race)
        with pytest.raises(SocketSetupError, match="in use"):
            bind_socket(path, None)
        monkeypatch.undo()
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(path)  # still the winner's


# --------------------------------------------------------------------------- switch-side methods


def _switched(addr: str, mode: str) -> SwitchResult:
    """What `Host.switch`/`recover` return (the switch-completed record)."""
    return SwitchResult(addr=addr, group=13, from_mode="nvidia", to_mode=mode,
                        members=[], duration_ms=1.0, changed=True)


class FakeSwitchWatcher:
    """Stands in for a watcher whose switch takes a while or fails in a given way."""

    def __init__(self, error: Exception | None = None, delay: float = 0) -> None:
        self.error, self.delay = error, delay
        self.calls: list[tuple[Any, ...]] = []
        self.finished = 0

    async def switch(
        self, target: str, mode: str, *, timeout: float = 90, tolerant: bool = False
    ) -> Any:
        self.calls.append(("switch", target, mode, timeout, tolerant))
        await anyio.sleep(self.delay)
        self.finished += 1
        if self.error is not None:
            raise self.error
        return _switched(target, mode)

    async def plan(self, target: str, mode: str) -> Any:
        return {"addr": target, "to_mode": mode, "steps": [], "refused": None}

    async def recover(self, target: str, *, timeout: float = 90) -> Any:
        return _switched(target, "vfio")

    async def holders(self, target: str) -> Any:
        return {"addr": target, "holders": []}


ROOT = PeerCred(pid=1, uid=0, gid=0, groups=frozenset({0}))


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (None, None),
        (SwitchRefused("the card is in use: qemu (pid 42) holds /dev/nvidia0"), P.SWITCH_REFUSED),
        (GroupPoisoned("group 13 wedged in this boot"), P.GROUP_POISONED),
        (GroupBusy("group 13 is switching"), P.GROUP_BUSY),
        (SwitchWedged("unbind did not return"), P.SWITCH_WEDGED),
        (SwitchFailed("nvidia did not bind"), P.SWITCH_FAILED),
        (NotPrivileged("switching needs root"), P.NOT_ROOT),
        (DeviceNotFound("no card of vendor 0x10de"), P.NOT_FOUND),
    ],
)
async def test_switch_delegates_and_maps_each_error(
    error: Exception | None, code: str | None
) -> None:
    fake = FakeSwitchWatcher(error)
    params = P.Params("switch", {"addr": NV, "mode": "vfio", "timeout": 5, "tolerant": True})
    if code is None:
        result = await default_ops()["switch"](fake, params, ROOT)  # type: ignore[arg-type]
        assert result == _switched(NV, "vfio").as_result()  # the reply shape, not the event
        assert "seq" not in result and result["changed"] is True
    else:
        with pytest.raises(P.RpcError) as info:
            await default_ops()["switch"](fake, params, ROOT)  # type: ignore[arg-type]
        assert info.value.code == code and str(error) in info.value.message
    assert fake.calls == [("switch", NV, "vfio", 5.0, True)]


@pytest.mark.parametrize(
    ("method", "params", "text"),
    [
        ("plan", {"mode": "vfio", "addr": NV, "vendor": "0x10de"}, "not both"),
        ("plan", {"mode": "host"}, "vfio or nvidia"),
        ("plan", {}, "'mode' is required"),
        # Finite and above 0: -1 was called "not non-negative", as if 0 were allowed.
        ("switch", {"mode": "vfio", "timeout": -1},
         "switch: 'timeout' must be a positive number, not -1"),
        ("switch", {"mode": "vfio", "timeout": 0},
         "switch: 'timeout' must be a positive number, not 0"),
        ("recover", {"timeout": 0.0}, "recover: 'timeout' must be a positive number, not 0.0"),
        # Above the bound by a hair: it was "not 90", the very bound the message names.
        ("switch", {"mode": "vfio", "timeout": 90.0000001}, "at most 90 seconds, not 90.0000001"),
        ("recover", {"timeout": 300}, "at most 90 seconds, not 300:"),
        ("switch", {"mode": "vfio", "tolerant": "yes"}, "true or false"),
        ("recover", {"addr": 13}, "a string"),
        ("holders", {"mode": "vfio"}, "unknown parameter 'mode'"),
    ],
)
async def test_switch_side_params_are_checked(
    method: str, params: dict[str, Any], text: str
) -> None:
    with pytest.raises(P.RpcError) as info:
        await default_ops()[method](FakeSwitchWatcher(), P.Params(method, params), ROOT)  # type: ignore[arg-type]
    assert info.value.code == P.INVALID_PARAMS and text in info.value.message


async def test_plan_holders_and_a_noop_switch_on_the_fixture(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    async with daemon(host, sockdir, tmp_path) as served:
        model = served.watcher.model
        c = await Raw.connect(served.path)
        reply = await c.request("plan", {"addr": NV, "mode": "vfio"})
        assert reply["result"] == jsonable(plan_for_host(model, "vfio", addr=NV).to_json())
        assert reply["result"]["steps"] and reply["result"]["refused"] is None
        steps = await c.request("probe", {"action": "plan", "mode": "vfio", "vendor": "0x10de"})
        assert steps["result"] == jsonable(model.probe("plan", mode="vfio", vendor="0x10de"))
        reply = await c.request("holders", {"addr": NV})
        assert reply["result"] == jsonable(holders_report(model, addr=NV))
        assert reply["result"]["holders"] == []
        # Already in mode: a no-op that writes nothing, answered by the real switch engine.
        reply = await c.request("switch", {"addr": NV, "mode": "nvidia"})
        assert reply["result"]["changed"] is False and reply["result"]["to_mode"] == "nvidia"
        reply = await c.request("switch", {"addr": "0000:0a:00.0", "mode": "vfio"})
        assert reply["error"]["code"] == P.NOT_FOUND
        host.add_process(4242, "qemu-system-x86", fds={5: "/dev/nvidia0"})
        reply = await c.request("plan", {"mode": "vfio"})
        assert reply["result"]["refused"]["holders"] == [
            {"pid": 4242, "comm": "qemu-system-x86", "node": "/dev/nvidia0"}
        ]
        reply = await c.request("probe", {"action": "plan", "mode": "vfio", "addr": NV})
        assert (
            reply["error"]["code"] == P.SWITCH_REFUSED and "pid 4242" in reply["error"]["message"]
        )
        reply = await c.request("holders", {})
        assert [h["pid"] for h in reply["result"]["holders"]] == [4242]
        await c.aclose()


async def test_a_switch_is_finished_when_its_client_leaves(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    fake = FakeSwitchWatcher(delay=0.3)
    ops = {"switch": lambda w, p, peer: default_ops()["switch"](fake, p, peer)}  # type: ignore[arg-type]
    async with daemon(host, sockdir, tmp_path, ops=ops) as served:
        c = await Raw.connect(served.path)
        await c.send(P.encode_request(1, "switch", {"addr": NV, "mode": "vfio"}))
        with anyio.fail_after(5):
            while not fake.calls:
                await anyio.sleep(0.01)
        await c.aclose()
        with anyio.fail_after(5):
            while served.server.connections:
                await anyio.sleep(0.01)
        assert fake.finished == 1  # shielded: not cut off half way
        c = await Raw.connect(served.path)
        reply = await c.request("switch", {"addr": NV, "mode": "vfio"}, rid=2)
        assert reply == {"id": 2, "result": _switched(NV, "vfio").as_result()}
        await c.aclose()


async def test_a_bug_asked_for_again_and_again_is_a_bounded_number_of_tracebacks(
    host: SysRoot, sockdir: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A request that hits a bug of ours is answered `internal-error` every time; its
    traceback goes to the journal a burst of times, then the rest are counted, not printed
    (a client asking for it in a loop would otherwise flood the journal)."""

    async def buggy(w: Any, p: Any, peer: Any) -> Any:
        raise ZeroDivisionError("a bug")

    caplog.set_level(logging.WARNING, logger="gpuwatch.service")
    async with daemon(host, sockdir, tmp_path, ops={"holders": buggy}) as served:
        c = await Raw.connect(served.path)
        for rid in range(300):
            reply = await c.request("holders", {"addr": NV}, rid=rid)
            assert reply == {"id": rid, "error": {"code": P.INTERNAL,
                                                  "message": "ZeroDivisionError: a bug"}}
        await c.aclose()
    tracebacks = [r for r in caplog.records if r.exc_info is not None]
    assert 1 <= len(tracebacks) <= 25  # a burst of 20, and about one a second after it
    assert tracebacks[0].getMessage().startswith("holders failed for ")
    assert tracebacks[0].exc_info is not None
    assert tracebacks[0].exc_info[0] is ZeroDivisionError


def _hangs(started: anyio.Event) -> Callable[[Any, Any, Any], Awaitable[Any]]:
    """An op that says it started and never answers (until the stop cancels it)."""

    async def never(w: Any, p: Any, peer: Any) -> Any:
        started.set()
        await anyio.sleep_forever()

    return never


async def test_a_request_in_flight_when_the_daemon_stops_is_told_so(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    """A stop (SIGTERM) cancels what is not a switch; the request it cut off gets one
    `unavailable` line saying why, not a connection reset with no reply."""
    started = anyio.Event()
    async with daemon(host, sockdir, tmp_path, ops={"holders": _hangs(started)}) as served:
        c = await Raw.connect(served.path)
        await c.send(P.encode_request(7, "holders", {}))
        with anyio.fail_after(5):
            await started.wait()
    rest = await c.eof()
    assert [json.loads(x) for x in rest.splitlines()] == [{"id": 7, "error": {
        "code": P.UNAVAILABLE, "message": "holders: the daemon is stopping; retry"}}]
    await c.aclose()


async def test_a_request_whose_task_never_started_before_the_stop_is_told_so(
    host: SysRoot, sockdir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that needs a task (holders, plan, a /proc probe) read in the loop turn a
    stop comes in is queued for the spawner, which the stop cancels before it starts it:
    it got no reply at all. It is now told `unavailable` like the rest, in order."""

    async def late_spawner(self: SocketServer, tg: Any) -> None:
        await anyio.sleep_forever()  # the stop comes before the spawner's next turn

    monkeypatch.setattr(SocketServer, "_spawner", late_spawner)
    async with daemon(host, sockdir, tmp_path) as served:
        c = await Raw.connect(served.path)
        await c.send(P.encode_request(3, "holders", {})
                     + P.encode_request(4, "probe", {"action": "detect-gpu"}))
        with anyio.fail_after(5):
            while not served.server._to_spawn:
                await anyio.sleep(0.01)
    rest = [json.loads(x) for x in (await c.eof()).splitlines()]
    await c.aclose()
    assert rest == [
        {"id": 3, "error": {"code": P.UNAVAILABLE,
                            "message": "holders: the daemon is stopping; retry"}},
        {"id": 4, "error": {"code": P.UNAVAILABLE,
                            "message": "probe: the daemon is stopping; retry"}},
    ]


async def test_requests_queued_behind_one_in_flight_are_each_told_the_daemon_stops(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    """Lines read but queued behind a running request (a connection answers in order)
    were dropped at a stop with no reply: each now gets the same `unavailable` line as the
    one in flight, in order (a line that is no request gets its own error, as ever)."""
    started = anyio.Event()
    async with daemon(host, sockdir, tmp_path, ops={"holders": _hangs(started)}) as served:
        c = await Raw.connect(served.path)
        # One write: read by the daemon in one go, the rest queued behind request 7.
        await c.send(P.encode_request(7, "holders", {}) + P.encode_request(8, "holders", {})
                     + b"not json\n" + P.encode_request(9, "probe", {"action": "detect-gpu"})
                     + P.encode_request("ten", "snapshot"))
        with anyio.fail_after(5):
            await started.wait()
        with anyio.fail_after(5):
            while not any(len(getattr(conn, "todo", ())) == 4
                          for conn in served.server.connections):
                await anyio.sleep(0.01)
    rest = [json.loads(x) for x in (await c.eof()).splitlines()]
    await c.aclose()
    stopping = [(r["id"], r["error"]["code"], r["error"]["message"]) for r in rest]
    assert stopping == [
        (7, P.UNAVAILABLE, "holders: the daemon is stopping; retry"),
        (8, P.UNAVAILABLE, "holders: the daemon is stopping; retry"),
        (None, P.PARSE_ERROR, stopping[2][2]),
        (9, P.UNAVAILABLE, "probe: the daemon is stopping; retry"),
        ("ten", P.UNAVAILABLE, "snapshot: the daemon is stopping; retry"),
    ]


async def test_all_clients_together_cannot_hold_more_unread_output_than_the_budget(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    """Each connection's unread output is bounded (``outbox_limit``), but nothing bounded
    them all together: ~960 other users' connections could hold 4 MiB each, 3.8 GiB. The
    daemon-wide budget (here 4 x 256 KiB) now cuts off the client with the most unread
    output when a write would pass it, and a client that reads is still served."""
    limit = 256 << 10
    async with daemon(host, sockdir, tmp_path, outbox_limit=limit,
                      output_budget=4 * limit) as served:
        server = served.server
        answered: dict[object, int] = {}
        send_result = server._send_result

        def counting(conn: Any, req: Any, result: Any) -> None:
            answered[conn] = answered.get(conn, 0) + 1
            send_result(conn, req, result)

        server._send_result = counting  # type: ignore[method-assign]
        clients: list[Raw] = []
        most = 0
        for _ in range(8):  # each fills half its own limit, reading nothing
            before = set(server.connections)
            c = await Raw.connect(served.path)
            clients.append(c)
            with anyio.fail_after(5):
                while not set(server.connections) - before:
                    await anyio.sleep(0.005)
            (conn,) = set(server.connections) - before
            sent = 0
            while not conn.closed and conn.buffered() <= limit // 2:
                await c.send(b"".join(P.encode_request(sent + i, "snapshot") for i in range(2)))
                sent += 2
                with anyio.fail_after(5):  # answered, or held while half its limit is unread
                    while (not conn.closed and answered.get(conn, 0) < sent
                           and conn.buffered() <= limit // 2):
                        await anyio.sleep(0.005)
                most = max(most, sum(x.buffered() for x in server.connections))
        assert most <= 4 * limit + 65536, most  # + one write to a client that kept up
        assert sum(x.buffered() for x in server.connections) <= 4 * limit + 65536
        assert len(server.connections) < 8  # the ones furthest behind were cut off
        # One that reads is served as ever.
        c = await Raw.connect(served.path)
        assert "result" in await c.request("probe", {"action": "detect-gpu"})
        await c.aclose()
        for c in clients:
            await c.aclose()


# --------------------------------------------------------------------------- clients and the CLI


async def test_sync_and_async_clients(host: SysRoot, sockdir: str, tmp_path: Path) -> None:
    async with daemon(host, sockdir, tmp_path) as served:

        def use_sync() -> tuple[Any, ...]:
            with Client(served.path, timeout=5) as c:
                mode = c.probe("current-mode", addr=NV)
                with pytest.raises(DaemonDeviceNotFound):
                    c.probe("current-mode", addr="0000:0a:00.0")
                with pytest.raises(DaemonUsageError):
                    c.probe("nonsense")
                seq = c.snapshot()["seq"]
                c.subscribe(addrs=[NIC])
                with pytest.raises(UsageError, match="streams events"):
                    c.probe("memlock")  # a streaming connection answers no calls
                return mode, seq

        assert await anyio.to_thread.run_sync(use_sync) == ("nvidia", 1)
        async with await AsyncClient.connect(served.path) as c:
            assert await c.probe("group-in-mode", addr=NV, mode="nvidia") is True
            assert await c.subscribe(addrs=[NIC]) == {"seq": 1, "complete": True}
            with pytest.raises(UsageError, match="streams events"):
                await c.probe("memlock")
            await toggle(served, host, NIC, "igb")
            async for event in c.events():
                assert (event["type"], event["addr"]) == ("driver-changed", NIC)
                break


@pytest.mark.parametrize("backend", BACKENDS)
def test_leaving_async_events_early_leaves_nothing_to_finalise(
    host: SysRoot, sockdir: str, tmp_path: Path, backend: str
) -> None:
    """``break`` out of ``async for event in c.events()`` (the documented loop, on either
    backend) warns of nothing: trio warns (ResourceWarning) of an async generator collected
    before it was exhausted, so as one the iterator failed a strict embedder's filter."""

    async def main() -> list[str]:
        async with daemon(host, sockdir, tmp_path) as served:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                async with await AsyncClient.connect(served.path) as c:
                    await c.subscribe(addrs=[NIC])
                    await toggle(served, host, NIC, "igb")
                    async for event in c.events(timeout=5):
                        assert event["addr"] == NIC
                        break
                    gc.collect()
                    await anyio.sleep(0)
                    # The loop left, the next event is still there for another.
                    await toggle(served, host, NIC, "igb")
                    async for event in c.events(timeout=5):
                        assert (event["addr"], event["new"]) == (NIC, "igb")
                        break
                    gc.collect()
                    await anyio.sleep(0)
            return [str(w.message) for w in caught]

    assert anyio.run(main, backend=backend) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_client_used_after_close_says_it_is_closed(
    host: SysRoot, sockdir: str, tmp_path: Path, backend: str
) -> None:
    """Both clients closed (twice: no error) and used again say in words that the client is
    closed, a `UsageError` (the caller's doing), also for an `events()` loop and for an
    `AsyncClient` closed by another task while this one waits for an event. Was: EBADF as
    a `DaemonUnavailable` ("connection ... broke: Bad file descriptor"), a bare `OSError`
    from `Client.events`, a bare `anyio.ClosedResourceError` from `AsyncClient.events`,
    and "the daemon closed the connection" for a close of the caller's own."""

    def blocking(path: str) -> list[str]:
        said: list[str] = []
        subscribed = Client(path)
        subscribed.subscribe(types=["driver-changed"])
        for c in (Client(path), subscribed):
            c.close()
            c.close()
            with pytest.raises(UsageError, match="client is closed") as info:
                c.probe("detect-gpu")
            said.append(str(info.value))
            with pytest.raises(UsageError, match="client is closed") as info:
                next(iter(c.events(timeout=1)))
            said.append(str(info.value))
        return said

    async def main() -> list[str]:
        said: list[str] = []
        async with daemon(host, sockdir, tmp_path) as served:
            c = await AsyncClient.connect(served.path)
            assert await c.probe("detect-gpu") is True
            await c.aclose()
            await c.aclose()
            with pytest.raises(UsageError, match="client is closed") as info:
                await c.probe("detect-gpu")
            said.append(str(info.value))
            with pytest.raises(UsageError, match="client is closed"):
                async for _event in c.events(timeout=1):
                    pass
            waiting = await AsyncClient.connect(served.path)
            await waiting.subscribe(types=["driver-changed"])

            async def close_soon() -> None:
                await anyio.sleep(0.05)
                await waiting.aclose()

            with anyio.fail_after(5):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(close_soon)
                    with pytest.raises(UsageError, match="client is closed"):
                        async for _event in waiting.events():
                            pass
            said += await anyio.to_thread.run_sync(blocking, served.path)
        return said

    said = anyio.run(main, backend=backend)
    assert len(said) == 5 and all(s == said[0] for s in said)


@contextlib.contextmanager
def listener_that_never_answers(sockdir: str) -> Iterator[tuple[str, Callable[[], bytes]]]:
    """A unix socket nobody answers: the callable returns what its one client has sent
    since the last look (accepted at the first look, held open until the end)."""
    path = f"{sockdir}/mute.sock"
    with contextlib.ExitStack() as stack:
        lsock = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        lsock.bind(path)
        lsock.listen(4)
        accepted: list[socket.socket] = []

        def sent() -> bytes:
            if not accepted:
                accepted.append(stack.enter_context(lsock.accept()[0]))
                accepted[0].setblocking(False)
            try:
                return accepted[0].recv(1 << 16)
            except BlockingIOError:
                return b""

        yield path, sent


@pytest.mark.parametrize(
    ("call", "text"),
    [
        # Sent as null, NaN was read as an absent timeout: a switch with the default 90 s.
        (lambda c: c.switch("vfio", addr=NV, timeout=float("nan")), "nan is no JSON number"),
        # Host.switch refuses an infinite timeout; through the client it was an OverflowError.
        (lambda c: c.switch("vfio", addr=NV, timeout=float("inf")), "inf is no JSON number"),
        # A name read with surrogateescape: a PydanticSerializationError, no UsageError.
        (lambda c: c.probe("current-mode", addr="0000:01:00.\udcff"), "is not UTF-8"),
        # Split into characters, it drew the daemon's "unknown event type '-'".
        (lambda c: c.subscribe_start(types="driver-changed"), "not one string"),
        (lambda c: c.subscribe_start(addrs=NV), "not one string"),
    ],
)
def test_the_client_refuses_what_it_cannot_send_as_the_model_would_and_sends_nothing(
    sockdir: str, call: Callable[[Client], Any], text: str
) -> None:
    """What JSON cannot carry, or a filter given as one string, is the caller's mistake: a
    `UsageError` as from the in-process model, raised before a byte goes out (a daemon that
    never answers is never waited for), and the connection takes the next call."""
    with listener_that_never_answers(sockdir) as (path, sent), Client(path, timeout=2) as c:
        with pytest.raises(UsageError, match=text) as info:
            call(c)
        assert not isinstance(info.value, DaemonError)
        assert sent() == b""
        with pytest.raises(TimeoutError):  # still usable: the next request goes out whole
            c.call("probe", {"action": "detect-gpu"}, timeout=0.2)
        line = sent()
        assert line.endswith(b"\n") and P.loads(line)["params"] == {"action": "detect-gpu"}


async def test_async_client_refuses_what_it_cannot_send(sockdir: str) -> None:
    with listener_that_never_answers(sockdir) as (path, sent):
        async with await AsyncClient.connect(path, timeout=2) as c:
            with pytest.raises(UsageError, match="nan is no JSON number"):
                await c.switch("vfio", addr=NV, timeout=float("nan"))
            with pytest.raises(UsageError, match="not one string"):
                await c.subscribe(types="driver-changed")
            assert sent() == b""


async def test_a_client_wait_too_long_for_a_socket_is_no_bound_not_an_overflow(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    """``timeout=float("inf")`` (or centuries) means no bound; a socket's timeout cannot
    hold it, and every such client or call failed with OverflowError before it asked."""
    async with daemon(host, sockdir, tmp_path) as served:

        def use() -> Any:
            with Client(served.path, timeout=float("inf")) as c:
                assert c.probe("current-mode", addr=NV) == "nvidia"
                assert c.call("probe", {"action": "detect-gpu"}, timeout=1e300) is True
                # The daemon's own refusal, not the client's crash: no switch is run.
                with pytest.raises(DaemonUsageError, match="at most 90 seconds, not 1e"):
                    c.switch("vfio", addr=NV, timeout=1e300)
                return c.probe("detect-gpu")

        assert await anyio.to_thread.run_sync(use) is True


def test_try_daemon_never_answers_a_fixture_root_from_the_default_socket(
    sockdir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = f"{sockdir}/gw.sock"
    listener = bind_socket(path, None)
    try:
        monkeypatch.setenv("GPUWATCH_SOCKET", path)  # stands in for the default path
        assert try_daemon(None, False, root=str(tmp_path)) is None
        client = try_daemon(None, False, root="/")
        assert client is not None
        client.close()
        assert try_daemon(None, True, root="/") is None  # --no-daemon
        explicit = try_daemon(path, False, root=str(tmp_path))  # --socket: always tried
        assert explicit is not None
        explicit.close()
        assert try_daemon(f"{sockdir}/nothing.sock", False, root="/") is None
    finally:
        listener.close()


async def test_cli_asks_the_daemon_when_one_answers(
    host: SysRoot, sockdir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(host.root)
    async with daemon(host, sockdir, tmp_path) as served:
        sock = ["--socket", served.path]
        for argv in (
            ["probe", "detect-vfio"],
            ["status", "--json"],
            ["status"],
            ["list"],
            ["list", "--json"],
            ["probe", "vfio-group-accessible", "--group", "13"],
        ):
            daemon_answer = await run_cli(capsys, *argv, "--root", root, *sock)
            direct = await run_cli(capsys, *argv, "--root", root)
            assert daemon_answer == direct, argv
        # Change the tree behind the watcher's back (no uevent): only a direct scan sees it.
        host.unbind(NIC)
        code, out, _ = await run_cli(
            capsys, "probe", "display-driver", "--addr", NIC, "--root", root, *sock
        )
        assert (code, json.loads(out)["result"]) == (0, "igb")
        code, out, _ = await run_cli(
            capsys, "probe", "display-driver", "--addr", NIC, "--root", root, *sock, "--no-daemon"
        )
        assert json.loads(out)["result"] == ""
        code, out, _ = await run_cli(
            capsys, "probe", "display-driver", "--addr", NIC, "--root", root
        )
        assert json.loads(out)["result"] == ""  # a fixture root never asks the default socket
        code, _, err = await run_cli(
            capsys, "probe", "display-driver", "--addr", "0000:0a:00.0", "--root", root, *sock
        )
        assert code == 1 and "no PCI function" in err and len(err.splitlines()) == 1
        assert served.watcher.seq == 1


async def test_half_closed_subscriber_streams_until_it_hangs_up(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    """`{ echo '{"id":1,"method":"subscribe"}'; } | socat …` style: EOF after the request,
    events keep coming; once the client is gone for good, the daemon lets go of it."""
    async with daemon(host, sockdir, tmp_path) as served:
        c = await Raw.connect(served.path)
        await c.send(P.encode_request(1, "subscribe"))
        await c.stream.send_eof()
        assert (await c.line())["result"]["seq"] == 1
        await toggle(served, host, NIC, "igb")
        assert (await c.line())["addr"] == NIC
        assert len(served.server.connections) == 1
        await c.aclose()
        with anyio.fail_after(5):
            while served.server.connections:
                await anyio.sleep(0.05)


def fake_daemon(path: str, reply: bytes | None) -> threading.Thread:
    """Answers one request with ``reply`` (or hangs up on it when None), then goes away."""
    listener = bind_socket(path, None)
    listener.setblocking(True)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.makefile("rb").readline()
            if reply is not None:
                conn.sendall(reply)
        listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(60)
@pytest.mark.parametrize("drip", [b"{", b'{"id": 99, "result": 1}\n'])
def test_a_call_gives_up_at_its_timeout_whatever_drips_in_meanwhile(
    sockdir: str, drip: bytes
) -> None:
    """What answers at the path may be hostile: a byte of a line that never ends, or lines
    that answer nothing of ours, each well within one read's timeout. A call's timeout, and
    the one `events` waits for each event, bound the whole wait, not each read: they raise,
    where they used to wait forever."""
    path = f"{sockdir}/gw.sock"
    listener = bind_socket(path, None)
    listener.setblocking(True)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                request = json.loads(conn.makefile("rb").readline())
                if request["method"] == "subscribe":
                    conn.sendall(P.encode_result(request["id"], {"seq": 0, "complete": True}))
                while not stop.wait(0.05):
                    try:
                        conn.sendall(drip)
                    except OSError:
                        break

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with Client(path, timeout=1) as c, pytest.raises(TimeoutError):
            c.probe("detect-gpu")
        with Client(path, timeout=1) as c:
            c.subscribe_start()
            with pytest.raises(TimeoutError):
                next(c.events(timeout=1))
    finally:
        stop.set()
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as wake:
            wake.connect(path)  # out of accept
        thread.join(timeout=10)
        listener.close()


@pytest.mark.parametrize(
    ("reply", "mutating", "outcome"),
    [
        (b'{"id": 1, "result": "nvidia"}\n', False, "answer"),
        (P.encode_error(1, P.PERMISSION_DENIED, "not in group"), False, "fallback"),
        (P.encode_error(1, P.PERMISSION_DENIED, "not in group"), True, "fallback"),
        (None, False, "fallback"),  # the daemon died mid-request: a read is simply redone here
        (None, True, "lost"),  # ... a switch is not: it may have started
        (b"HTTP/1.1 400 Bad Request\n", False, "fallback"),  # not a gpuwatch socket
        (P.encode_error(1, P.SWITCH_REFUSED, "held by qemu"), True, "error"),
    ],
)
def test_ask_daemon_falls_back_only_when_that_is_safe(
    sockdir: str, reply: bytes | None, mutating: bool, outcome: str
) -> None:
    path = f"{sockdir}/gw.sock"
    thread = fake_daemon(path, reply)
    args = argparse.Namespace(socket=path, no_daemon=False, root="/", config=None)
    try:
        answer = ask_daemon(args, lambda c: c.probe("current-mode", addr=NV), mutating=mutating)
    except DaemonLost:
        assert outcome == "lost"
    except DaemonError as exc:
        assert outcome == "error" and exc.code == P.SWITCH_REFUSED
    else:
        assert outcome == ("answer" if answer is not None else "fallback")
        assert answer is None or answer.value == "nvidia"
    thread.join(5)


def test_client_refuses_a_reply_longer_than_its_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hostile or broken daemon streaming one endless line: the client gives up at its cap
    (holding no more than that) with a one-line error instead of reading forever; the lines
    before it are still read."""
    from gpuwatch.service import client as client_mod

    monkeypatch.setattr(client_mod, "_MAX_REPLY", 4096)
    with short_socket_dir() as where:
        path = os.path.join(where, "fake.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)

        def serve() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(1 << 16)
                conn.sendall(b'{"id":1,"result":"first"}\n' + b'{"id":2,"result":"')
                with contextlib.suppress(OSError):
                    for _ in range(64):
                        conn.sendall(b"z" * 1024)
                    conn.recv(1)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            with Client(path, timeout=10) as c:
                assert c.call("probe", {"action": "x"}) == "first"
                with pytest.raises(client_mod.DaemonUnavailable, match="longer than 4096"):
                    c.call("probe", {"action": "y"})
        finally:
            listener.close()
            thread.join(10)


@pytest.mark.timeout(60)
async def test_a_subscriber_that_sent_eof_is_streamed_to_until_it_hangs_up(
        host: SysRoot, sockdir: str, tmp_path: Path) -> None:
    """A subscriber may close its sending side (``SHUT_WR``) and go on reading: events still
    reach it; once it closes the socket too, the daemon lets the connection go."""
    async with daemon(host, sockdir, tmp_path) as served:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(served.path)
        client.sendall(P.encode_request(1, "subscribe", {"types": ["driver-changed"]}))
        client.setblocking(False)

        async def line() -> dict[str, Any]:
            data = b""
            with anyio.fail_after(10):
                while not data.endswith(b"\n"):
                    await anyio.wait_readable(client)
                    data += client.recv(65536)
            return dict(P.loads(data.split(b"\n")[0]))

        assert "result" in await line()
        client.shutdown(socket.SHUT_WR)
        await anyio.sleep(0.1)  # its EOF read by the daemon
        await toggle(served, host, NIC, "igb")
        event = await line()
        assert (event["type"], event["addr"]) == ("driver-changed", NIC)
        client.close()
        with anyio.fail_after(10):  # polled once a second
            while served.server.connections:
                await anyio.sleep(0.05)


def test_config_names_the_file_the_daemon_read_and_where_its_root_came_from(
    host: SysRoot, tmp_path: Path
) -> None:
    """``config``: the file a real daemon read and checked at start, by path and identity
    (what `os.stat` of it shows while it is unchanged), and its root with where that came
    from: what a command needs to know its own file is that one, without reading it."""
    from daemon_helpers import Daemon, Lines, connect

    from gpuwatch.core.tabledata import tables_json
    from gpuwatch.settings import file_identity, load_tables

    config = tmp_path / "config.yaml"
    config.write_text(f"log_keep: 3\nroot: {host.root}\n"
                      'gpu_vendors:\n  "0x10DE": Team Green\n')
    tables = tables_json(load_tables(str(config)))
    assert tables["gpu_vendors"] == {"0x10de": "Team Green"}  # as the model spells ids
    for root_flag, root_from in ((True, "flag"), (False, "file")):
        with short_socket_dir() as sockdir:
            work = tmp_path / f"work-{root_flag}"
            work.mkdir()
            sock = f"{sockdir}/gw.sock"
            with Daemon(host.root, work, sock, "--config", str(config), root_flag=root_flag), \
                    connect(sock) as s:
                lines = Lines(s)
                assert lines.request("config") == {"id": 1, "result": {
                    "path": str(config), "identity": list(file_identity(config.stat())),
                    "root": str(host.root), "root_from": root_from, "tables": tables}}
                reply = lines.request("config", {"path": "/etc"}, rid=2)
                assert reply["error"]["code"] == P.INVALID_PARAMS, reply


async def test_config_of_a_server_given_no_settings_names_no_file(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    """A server built in a program of its own read no file for it: none is named, and its
    root is the caller's (``flag``), so no command takes a file's root from it; its tables
    are its watcher's."""
    from gpuwatch.core.tabledata import tables_json
    from gpuwatch.settings import default_tables

    async with daemon(host, sockdir, tmp_path) as served:
        c = await Raw.connect(served.path)
        assert (await c.request("config"))["result"] == {
            "path": None, "identity": None, "root": str(host.root), "root_from": "flag",
            "tables": tables_json(default_tables())}
        await c.aclose()
        # The Python clients ask it by name, as they ask every other method.
        async with await AsyncClient.connect(served.path) as client:
            answer = await client.config()
        assert (answer["path"], answer["root"]) == (None, str(host.root))

        def use_sync() -> dict[str, Any]:
            with Client(served.path, timeout=5) as client:
                return client.config()

        assert await anyio.to_thread.run_sync(use_sync) == answer
