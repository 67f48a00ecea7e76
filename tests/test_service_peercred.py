"""Who may do what on the socket, decided from real SO_PEERCRED credentials.

The clients here are forked children that drop to uid 65534 with chosen groups before they
connect, so the kernel, not the test, vouches for who they are.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from gpuwatch.service import peers
from gpuwatch.service import protocol as P
from gpuwatch.service.ops import default_ops
from gpuwatch.service.peers import AccessPolicy, PeerCred, peer_credentials, peer_memlock
from gpuwatch.service.testing import served_watcher, short_socket_dir
from gpuwatch.testing import SysRoot

NOBODY = 65534
READERS = 424201  # the --socket-group
SWITCHERS = 424202  # the --switch-group
NV = "0000:01:00.0"


def _peer_option_works(option: int, size: int = 0) -> bool:
    """Whether this kernel answers the socket option ``option`` on a connected pair (an
    option of the value's size, 0 for an int; a pidfd it hands out is closed again)."""
    a, b = socket.socketpair(socket.AF_UNIX)
    try:
        value = a.getsockopt(socket.SOL_SOCKET, option, size) if size else (
            a.getsockopt(socket.SOL_SOCKET, option))
        if isinstance(value, int):
            os.close(value)
    except OSError:
        return False
    finally:
        a.close()
        b.close()
    return True


def _peergroups_work() -> bool:
    return _peer_option_works(getattr(socket, "SO_PEERGROUPS", 59), 256)


pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not _peergroups_work(),
    reason="needs root (to drop to another uid) and SO_PEERGROUPS (Linux 4.13+)",
)


@pytest.fixture
def sockdir() -> Iterator[str]:
    with short_socket_dir() as path:
        yield path


def _child(
    path: str, groups: Sequence[int], requests: Sequence[bytes], memlock: int | None, out: int
) -> None:
    result: dict[str, Any] = {}
    try:
        if memlock is not None:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (memlock, memlock))
        os.setgroups(list(groups))
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        result["pid"] = os.getpid()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        try:
            sock.connect(path)
        except OSError as exc:
            result["connect_errno"] = exc.errno
        else:
            reader = sock.makefile("rb")
            replies = []
            result["replies"] = replies
            for request in requests:
                # The daemon may have closed already (EPIPE): its reply may still be queued.
                with contextlib.suppress(OSError):
                    sock.sendall(request)
                try:
                    line = reader.readline()
                except OSError:  # ECONNRESET: closed with our request unread
                    line = b""
                if not line:
                    result["closed"] = True
                    break
                replies.append(json.loads(line))
    except BaseException as exc:  # report, never run the parent's code in the child
        result["crash"] = repr(exc)
    finally:
        os.write(out, json.dumps(result).encode())
        os._exit(0)


async def as_nobody(
    path: str,
    groups: Sequence[int],
    *requests: tuple[str, dict[str, Any]],
    memlock: int | None = None,
) -> dict[str, Any]:
    """Fork, drop to uid/gid 65534 with ``groups``, connect, send ``requests``, report."""
    lines = [P.encode_request(i, method, params) for i, (method, params) in enumerate(requests)]
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(rfd)
        _child(path, groups, lines, memlock, wfd)
    os.close(wfd)

    def collect() -> bytes:
        data = b""
        while chunk := os.read(rfd, 65536):
            data += chunk
        os.close(rfd)
        os.waitpid(pid, 0)
        return data

    result: dict[str, Any] = json.loads(await anyio.to_thread.run_sync(collect))
    assert "crash" not in result, result
    return result


def codes(result: dict[str, Any]) -> list[str]:
    return [r["error"]["code"] if "error" in r else "ok" for r in result["replies"]]


async def fake_switch(watcher: Any, params: P.Params, peer: PeerCred) -> Any:
    params.opt_str("addr")
    params.opt_str("mode")
    params.done()
    return {"switched_for_uid": peer.uid}


OPS = {**default_ops(), "switch": fake_switch, "recover": fake_switch}
READS = [
    ("probe", {"action": "detect-gpu"}),
    ("snapshot", {}),
    ("holders", {"addr": NV}),
    ("plan", {"addr": NV, "mode": "vfio"}),
]
WRITES = [("switch", {"addr": NV, "mode": "vfio"}), ("recover", {"addr": NV})]


async def test_socket_group_reads_and_only_the_switch_group_switches(
    host: SysRoot, sockdir: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = f"{sockdir}/gw.sock"
    caplog.set_level(logging.WARNING, logger="gpuwatch.service")
    async with served_watcher(host.root, path, read_gid=READERS, switch_gid=SWITCHERS, ops=OPS):
        reader = await as_nobody(path, [READERS], *READS, *WRITES, ("subscribe", {}))
        assert codes(reader) == ["ok"] * len(READS) + [P.PERMISSION_DENIED] * 2 + ["ok"]
        refusal = reader["replies"][len(READS)]["error"]["message"]
        assert "--switch-group" in refusal and f"uid {NOBODY} pid {reader['pid']}" in refusal
        assert f"refused switch for uid {NOBODY} pid {reader['pid']}" in caplog.text

        switcher = await as_nobody(path, [READERS, SWITCHERS], *READS, *WRITES)
        assert codes(switcher) == ["ok"] * (len(READS) + 2)
        assert switcher["replies"][len(READS)]["result"] == {"switched_for_uid": NOBODY}

        outsider = await as_nobody(path, [], *READS)
        assert outsider["connect_errno"] == 13  # EACCES: the 0660 root:group file keeps it out

        # Even if the file mode were loosened, the peer check still refuses an outsider: at
        # accept, with one line (id null: none of its bytes was parsed), then the close.
        os.chmod(path, 0o666)
        outsider = await as_nobody(path, [12345], *READS, *WRITES)
        assert codes(outsider) == [P.PERMISSION_DENIED] and outsider["closed"]
        assert outsider["replies"][0]["id"] is None
        assert "--socket-group" in outsider["replies"][0]["error"]["message"]


async def test_without_groups_only_root_may_do_anything(host: SysRoot, sockdir: str) -> None:
    path = f"{sockdir}/gw.sock"
    async with served_watcher(host.root, path, read_gid=None, switch_gid=None, ops=OPS):
        assert os.stat(path).st_gid == 0
        os.chmod(path, 0o666)
        nobody = await as_nobody(path, [0], *READS, *WRITES)  # group root is not uid root
        assert codes(nobody) == [P.PERMISSION_DENIED] and nobody["closed"]

        def as_root() -> list[Any]:  # and root itself may do everything
            with socket.socket(socket.AF_UNIX) as sock:
                sock.settimeout(10)
                sock.connect(path)
                reader = sock.makefile("rb")
                replies = []
                for i, (method, params) in enumerate([*READS, *WRITES]):
                    sock.sendall(P.encode_request(i, method, params))
                    replies.append(json.loads(reader.readline()))
                return replies

        replies = await anyio.to_thread.run_sync(as_root)
        assert ["result" in r for r in replies] == [True] * (len(READS) + 2), replies


async def test_access_probes_answer_for_the_peer(host: SysRoot, sockdir: str) -> None:
    host.add_vfio_group(13, mode=0o660)
    os.chown(host.root / "dev/vfio/13", 0, READERS)
    host.add_vfio_group(14, mode=0o600)
    path = f"{sockdir}/gw.sock"
    async with served_watcher(host.root, path, read_gid=READERS):
        result = await as_nobody(
            path,
            [READERS],
            ("probe", {"action": "vfio-group-accessible", "group": 13}),
            ("probe", {"action": "vfio-group-accessible", "group": 14}),
            ("probe", {"action": "memlock"}),
            memlock=65536,
        )
        assert [r["result"] for r in result["replies"][:2]] == [True, False]  # what *it* may open
        assert result["replies"][2]["result"] == {"soft": 65536, "hard": 65536}  # its own limit


async def test_a_group_node_chowned_without_a_uevent_is_answered_within_a_second(
    host: SysRoot, sockdir: str
) -> None:
    """udev gives a group node its group and mode after the kernel's ``add`` uevent (which
    the default kernel source reads before udev runs), and libvirt and KubeVirt chown it or
    set an ACL for a VM's user: no uevent says so. The daemon kept the stat it took at the
    event until the next reconcile (5 minutes by default, never with 0), so the VM's user
    was told false all that while; the group nodes are now looked at again every second."""
    host.add_vfio_group(13, mode=0o600)  # as devtmpfs makes it, before udev's rules
    node = host.root / "dev/vfio/13"
    path = f"{sockdir}/gw.sock"
    ask = ("probe", {"action": "vfio-group-accessible", "group": 13})

    async def answer_turns(expected: bool) -> float:
        start = time.monotonic()
        while time.monotonic() - start < 10:
            result = await as_nobody(path, [READERS], ask)
            if result["replies"][0]["result"] is expected:
                return time.monotonic() - start
            await anyio.sleep(0.1)
        raise AssertionError(f"still not {expected} after 10 s")

    async with served_watcher(host.root, path, read_gid=READERS):  # no reconcile
        assert (await as_nobody(path, [READERS], ask))["replies"][0]["result"] is False
        os.chown(node, 0, READERS)  # udev's GROUP= and MODE=
        os.chmod(node, 0o660)
        assert await answer_turns(True) < 3
        os.chmod(node, 0o600)
        assert await answer_turns(False) < 3
        # setfacl -m u:nobody:rw (mode 0660 shown: the mask), the owning group refused
        acl = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in (
            (1, 6, 0xFFFFFFFF), (2, 6, NOBODY), (4, 0, 0xFFFFFFFF), (16, 6, 0xFFFFFFFF),
            (32, 0, 0xFFFFFFFF)))
        os.chown(node, 0, 0)
        os.setxattr(node, "system.posix_acl_access", acl)
        assert await answer_turns(True) < 3


async def test_without_so_peergroups_a_slow_group_database_stalls_no_one(
    host: SysRoot, sockdir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the kernel lacks SO_PEERGROUPS (before 4.13) a peer's groups come from the group
    database, which may hang on the network (LDAP, sssd). That lookup ran on the event loop:
    one connecting peer stalled every client. It now runs in a thread, root is served
    meanwhile, and a peer whose lookup takes longer than the bound is refused at accept
    (``unavailable``, retry) instead of being waited for; a lookup in time admits it."""
    release = threading.Event()
    started = threading.Event()
    ended = threading.Event()

    def slow_groups(uid: int, gid: int) -> list[int]:
        started.set()
        release.wait(60)  # the group database, stuck on the network until released
        ended.set()
        return [READERS]

    monkeypatch.setattr(peers, "_peer_groups", lambda sock: None)
    monkeypatch.setattr(peers, "_db_groups", slow_groups)
    path = f"{sockdir}/gw.sock"
    try:
        async with served_watcher(host.root, path, read_gid=READERS, groups_timeout=2):
            os.chmod(path, 0o666)  # the file mode is not what this test is about
            async with anyio.create_task_group() as tg:
                slow: dict[str, Any] = {}

                async def connect_slow() -> None:
                    slow.update(await as_nobody(path, [READERS],
                                                ("probe", {"action": "detect-gpu"})))

                tg.start_soon(connect_slow)
                await anyio.to_thread.run_sync(started.wait, 20)
                assert started.is_set()

                def as_root() -> Any:
                    with socket.socket(socket.AF_UNIX) as sock:
                        sock.settimeout(10)
                        sock.connect(path)
                        sock.sendall(P.encode_request(1, "probe", {"action": "detect-gpu"}))
                        return json.loads(sock.makefile("rb").readline())

                assert "result" in await anyio.to_thread.run_sync(as_root)
                assert not ended.is_set()  # answered while the lookup was still stuck
            assert slow["replies"][0]["id"] is None, slow
            assert slow["replies"][0]["error"]["code"] == P.UNAVAILABLE, slow
            assert "group database" in slow["replies"][0]["error"]["message"], slow
            release.set()  # a database that answers in time: the peer is admitted
            fine = await as_nobody(path, [], ("probe", {"action": "detect-gpu"}))
            assert codes(fine) == ["ok"], fine
    finally:
        release.set()


async def test_refusals_do_not_look_the_groups_up_again_on_the_event_loop(
    host: SysRoot, sockdir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refusal names the group that would be needed. Its name came from the group
    database (which may block on the network) on the event loop, at every refusal: a peer
    refused over and over stalled everyone each time. The names are looked up once, at
    start."""
    lookups: list[int] = []
    real = peers.grp.getgrgid

    def counted(gid: int) -> Any:
        lookups.append(gid)
        return real(gid)

    monkeypatch.setattr(peers.grp, "getgrgid", counted)
    peers.group_label.cache_clear()
    path = f"{sockdir}/gw.sock"
    async with served_watcher(host.root, path, read_gid=READERS, switch_gid=SWITCHERS,
                              ops=OPS):
        at_start = len(lookups)
        os.chmod(path, 0o666)
        for _ in range(3):
            outsider = await as_nobody(path, [12345], *READS)
            assert codes(outsider) == [P.PERMISSION_DENIED], outsider
            reader = await as_nobody(path, [READERS], *WRITES)
            assert codes(reader) == [P.PERMISSION_DENIED] * 2, reader
            assert "--switch-group" in reader["replies"][0]["error"]["message"]
        assert len(lookups) == at_start, lookups


def test_peer_credentials_of_a_socketpair() -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    try:
        cred = peer_credentials(a)
    finally:
        a.close()
        b.close()
    assert (cred.pid, cred.uid, cred.gid) == (os.getpid(), os.geteuid(), os.getegid())
    assert set(os.getgroups()) | {os.getegid()} <= cred.groups
    # A live peer keeps its start time (its pidfd vouches for it where the kernel has one).
    assert cred.start is not None and cred.start == peers.process_start(os.getpid())
    assert cred.still_there()


@pytest.mark.skipif(not _peer_option_works(77),  # SO_PEERPIDFD
                    reason="the kernel lacks SO_PEERPIDFD (Linux 6.5+)")
def test_a_peer_gone_before_the_accept_is_not_vouched_for_by_whoever_has_its_pid(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer connects and exits before the daemon accepts; its pid goes to another
    process (played here by the start-time read answering for a live one). That start time
    must not be taken as the peer's: with it, `still_there` would say yes and `memlock`
    answer with the newcomer's limit."""
    with short_socket_dir() as where:
        path = str(Path(where) / "s")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(path)
            listener.listen(1)
            peer = subprocess.run(  # the peer: connect, and go (reaped: its pid is free)
                [sys.executable, "-c", "import os, socket, sys\n"
                 "socket.socket(socket.AF_UNIX).connect(sys.argv[1]); print(os.getpid())",
                 path], capture_output=True, text=True, timeout=30, check=True)
            pid = int(peer.stdout)
            conn, _ = listener.accept()
            with conn:
                reused = peers.process_start(os.getpid())  # a live process's start time
                monkeypatch.setattr(peers, "process_start", lambda p, proc="/proc": reused)
                cred = peer_credentials(conn)
    assert cred.pid == pid
    assert cred.start is None
    assert not cred.still_there()


@pytest.mark.parametrize(
    ("uid", "groups", "read", "switch"),
    [
        (0, set(), True, True),
        (1000, {READERS}, True, False),
        (1000, {SWITCHERS}, True, True),
        (1000, {7}, False, False),
        (1000, set(), False, False),
    ],
)
def test_access_policy(uid: int, groups: set[int], read: bool, switch: bool) -> None:
    policy = AccessPolicy(read_gid=READERS, switch_gid=SWITCHERS)
    peer = PeerCred(pid=1, uid=uid, gid=uid, groups=frozenset(groups | {uid}))
    assert [
        policy.allows(m, peer)
        for m in ("probe", "snapshot", "subscribe", "plan", "holders", "config")
    ] == [read] * 6
    assert [policy.allows(m, peer) for m in ("switch", "recover")] == [switch] * 2


def test_peer_memlock_reads_proc_limits(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7/limits").write_text(
        "Limit                     Soft Limit           Hard Limit           Units     \n"
        "Max locked memory         8388608              unlimited            bytes     \n"
    )
    limit = peer_memlock(7, str(tmp_path))
    assert limit is not None and (limit.soft, limit.hard) == (8388608, None)
    assert peer_memlock(8, str(tmp_path)) is None
