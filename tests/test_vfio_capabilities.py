"""vfio-group-accessible and CAP_DAC_OVERRIDE, against the kernel itself: real processes
with chosen capabilities (``setpriv``) open the node the probe judges, and ask the probe.

Root without CAP_DAC_OVERRIDE (a container that dropped it) is refused a node owned by
another user with mode 0600, as libvirt leaves a group node it chowned to qemu, and was
told ``true`` ("root always may"); a process of another uid granted the capability may
open it, and was told ``false``. The fixture's node is a regular file: the kernel's
permission check is the same for it as for a char device."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from gpuwatch.core.observations import NodeStat
from gpuwatch.core.probes import may_read_write
from gpuwatch.hostfs import procfs
from gpuwatch.hostfs.procfs import (
    CAP_DAC_OVERRIDE,
    dac_override,
    effective_capabilities,
    in_our_user_namespace,
    parse_cap_eff,
)
from gpuwatch.service import protocol as P
from gpuwatch.service.peers import PeerCred, peer_dac_override, process_start
from gpuwatch.service.testing import served_watcher, short_socket_dir
from gpuwatch.testing import example_gpu_host

REPO = Path(__file__).resolve().parent.parent
GROUP = 7
QEMU = 12345  # the node's owner, as libvirt chowns it
OTHER = 12346  # a caller that is neither root nor the owner
READERS = 424203  # the daemon's --socket-group

#: setpriv flags for each kind of caller. Root drops CAP_DAC_OVERRIDE from its bounding and
#: inheritable sets (the execve then leaves it out of the effective set); the other user
#: keeps it as an ambient capability across the uid change and the execve.
ROOT_WITHOUT = ["--bounding-set=-dac_override", "--inh-caps=-dac_override"]
OTHER_WITH = [f"--reuid={OTHER}", f"--regid={OTHER}", f"--groups={READERS}",
              "--inh-caps=+dac_override", "--ambient-caps=+dac_override"]
# (A user without it is left to test_vfio_access and test_service_peercred: the interpreter
# running the tests may live where other users cannot run it.)

needs_root_and_setpriv = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None
    or not (procfs.own_dac_override() or False),
    reason="needs root with CAP_DAC_OVERRIDE (to give and drop it) and setpriv",
)


# ------------------------------------------------------------------ the parser


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\nCapBnd:\t0\n",
         0x1FFFFFFFFFF),
        (b"CapEff:\t0000000000000002", 2),  # no newline at the end
        (b"CapEff:\t0000000000000000\n", 0),
        (b"CapEff:\t00000000000000FD\n", 0xFD),
        (b"", None),
        (b"Name:\tx\nCapPrm:\t000001ffffffffff\n", None),  # no CapEff line
        (b"CapEff:\n", None),
        (b"CapEff:\t\n", None),
        (b"CapEff:\t0x2\n", None),  # int(, 16) would take these; the kernel never writes them
        (b"CapEff:\t-2\n", None),
        (b"CapEff:\t+2\n", None),
        (b"CapEff:\t0_2\n", None),
        (b"CapEff:\t00 02\n", None),
        (b"CapEff:\tzzzz\n", None),
        (b"CapEff:\t\xff\xfe\n", None),
        (b"CapEff:\t\xd9\xa2\n", None),  # an Arabic-Indic digit, which int() accepts as text
        (b"\x00\x00\x00", None),
        (b"capeff:\t2\n", None),
    ],
)
def test_cap_eff_parser(text: bytes, expected: int | None) -> None:
    assert parse_cap_eff(text) == expected


def test_capabilities_of_a_process_tree(tmp_path: Path) -> None:
    """Read as /proc lays them out; a process with no readable status is not known, and a
    status cut short before the line says nothing either."""
    proc = tmp_path / "proc"
    (proc / "42").mkdir(parents=True)
    groups = " ".join(str(g) for g in range(60000))  # a Groups: line far longer than a page
    (proc / "42/status").write_text(f"Name:\tqemu\nGroups:\t{groups}\n"
                                    "CapEff:\t0000000000000002\nCapBnd:\t0\n")
    (proc / "43").mkdir()
    (proc / "43/status").mkdir()  # not a file
    (proc / "44").mkdir()
    (proc / "44/status").write_text("Name:\tx\nCapEff:\tnope\n")
    assert effective_capabilities(42, str(proc)) == 2
    assert effective_capabilities(43, str(proc)) is None
    assert effective_capabilities(44, str(proc)) is None
    assert effective_capabilities(45, str(proc)) is None
    assert dac_override(2) is True and dac_override(0x1FFFFFFFFFD) is False
    assert dac_override(None) is None
    assert CAP_DAC_OVERRIDE == 1


def test_own_capabilities_are_those_the_kernel_shows() -> None:
    status = Path("/proc/self/status").read_text()
    line = next(x for x in status.splitlines() if x.startswith("CapEff:"))
    assert effective_capabilities() == int(line.split()[1], 16)
    assert effective_capabilities(os.getpid()) == int(line.split()[1], 16)


# ------------------------------------------------------------------ the rule


@pytest.mark.parametrize(
    ("uid", "override", "expected"),
    [
        (0, None, True),  # not known: root is taken to have it (the rule as it was)
        (0, True, True),
        (0, False, False),  # root without it: judged by the bits like anyone
        (OTHER, None, False),
        (OTHER, False, False),
        (OTHER, True, True),  # another user with it may open anything
        (QEMU, False, True),  # the owner, by the bits
    ],
)
def test_dac_override_rule(uid: int, override: bool | None, expected: bool) -> None:
    stat = NodeStat(mode=0o600, uid=QEMU, gid=QEMU)
    assert may_read_write(stat, uid, frozenset({uid}), override) is expected


# ------------------------------------------------------------------ real processes


@pytest.fixture
def node_root() -> Iterator[Path]:
    """A host tree (in a folder others may walk) whose ``/dev/vfio/7`` is owned by uid
    12345, mode 0600: no one but that user, and a holder of CAP_DAC_OVERRIDE, may open it."""
    base = tempfile.mkdtemp(prefix="gw-vfio-caps-")
    try:
        os.chmod(base, 0o755)
        host = example_gpu_host(Path(base) / "root")
        host.add_vfio_group(GROUP)
        node = host.root / f"dev/vfio/{GROUP}"
        os.chown(node, QEMU, QEMU)
        os.chmod(node, 0o600)
        for path in (host.root, host.root / "dev", host.root / "dev/vfio"):
            os.chmod(path, 0o755)
        yield host.root
    finally:
        subprocess.run(["rm", "-rf", base], check=False)


#: The start of each child's script: its CapEff, and what the kernel decides for an O_RDWR
#: open of ``node`` in its credentials.
_WHO_AND_KERNEL = """status = open("/proc/self/status").read()
cap_eff = int(next(l for l in status.splitlines() if l.startswith("CapEff:")).split()[1], 16)
try:
    os.close(os.open(node, os.O_RDWR))
    kernel = True
except PermissionError:
    kernel = False
"""

#: Run in the caller's credentials: its CapEff, what the kernel decides for an O_RDWR open
#: of the node, and the probe's answer three ways (the cold direct CLI path, the full CLI
#: path, the library), as JSON.
_CALLER = """
import json, os, subprocess, sys
root, node = sys.argv[1], sys.argv[2]
""" + _WHO_AND_KERNEL + """
cli = [sys.executable, "-m", "gpuwatch", "probe", "vfio-group-accessible", "--group", "7",
       "--root", root, "--no-daemon"]
direct = subprocess.run(cli, capture_output=True, text=True, check=True, cwd="/")
full = subprocess.run(cli, capture_output=True, text=True, check=True, cwd="/",
                      env={**os.environ, "GPUWATCH_PROC_READ_TIMEOUT": "2"})
import gpuwatch
library = gpuwatch.scan(root).probe("vfio-group-accessible", group=7)
print(json.dumps({"cap_eff": cap_eff, "kernel": kernel, "library": library,
                  "direct": json.loads(direct.stdout)["result"],
                  "full": json.loads(full.stdout)["result"]}))
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    env["PYTHONPATH"] = str(REPO)
    return env


def _as_caller(flags: list[str], root: Path) -> dict[str, Any]:
    """What a process started by ``setpriv FLAGS`` sees and is told."""
    node = root / f"dev/vfio/{GROUP}"
    done = subprocess.run(["setpriv", *flags, "--", sys.executable, "-c", _CALLER, str(root),
                           str(node)], capture_output=True, text=True, env=_env(), cwd="/",
                          timeout=90)
    assert done.returncode == 0, done.stderr
    said: dict[str, Any] = json.loads(done.stdout)
    return said


@needs_root_and_setpriv
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("flags", "has_it", "kernel"),
    [
        ([], True, True),  # root as it is
        (ROOT_WITHOUT, False, False),  # root in a container that dropped it
        (OTHER_WITH, True, True),  # another user granted it
    ],
    ids=["root", "root-without-dac-override", "user-with-dac-override"],
)
def test_the_probe_says_what_the_kernel_decides_for_the_callers_capabilities(
    node_root: Path, flags: list[str], has_it: bool, kernel: bool
) -> None:
    """In process (the library, the full CLI) and on the cold direct CLI path, the answer is
    what the caller's own open(O_RDWR) gets, for its capabilities as well as its uid."""
    said = _as_caller(flags, node_root)
    assert bool(said["cap_eff"] >> CAP_DAC_OVERRIDE & 1) is has_it  # setpriv did as meant
    assert said["kernel"] is kernel
    assert (said["direct"], said["full"], said["library"]) == (kernel, kernel, kernel), said


#: A socket client in the caller's credentials: its CapEff, the kernel's decision, and the
#: daemon's answer to vfio-group-accessible asked twice on one connection.
_CLIENT = """
import json, os, socket, sys
path, node = sys.argv[1], sys.argv[2]
""" + _WHO_AND_KERNEL + """
sock = socket.socket(socket.AF_UNIX)
sock.settimeout(20)
sock.connect(path)
reader = sock.makefile("rb")
replies = []
for rid in (1, 2):
    req = {"id": rid, "method": "probe",
           "params": {"action": "vfio-group-accessible", "group": 7}}
    sock.sendall(json.dumps(req).encode() + b"\\n")
    replies.append(json.loads(reader.readline()))
print(json.dumps({"cap_eff": cap_eff, "kernel": kernel, "replies": replies}))
"""


@needs_root_and_setpriv
@pytest.mark.timeout(180)
async def test_the_daemon_answers_for_the_peers_capabilities(node_root: Path) -> None:
    """A daemon that holds CAP_DAC_OVERRIDE answers each peer for the peer's own: root
    that dropped it is refused the qemu user's node, as its open is, and another user
    granted it may open it; the answer holds for the whole connection."""
    with short_socket_dir() as sockdir:
        path = f"{sockdir}/gw.sock"
        async with served_watcher(node_root, path, read_gid=READERS):

            def ask(flags: list[str]) -> dict[str, Any]:
                done = subprocess.run(
                    ["setpriv", *flags, "--", sys.executable, "-c", _CLIENT, path,
                     str(node_root / f"dev/vfio/{GROUP}")],
                    capture_output=True, text=True, env=_env(), cwd="/", timeout=60)
                assert done.returncode == 0, done.stderr
                said: dict[str, Any] = json.loads(done.stdout)
                return said

            for flags, has_it, kernel in ((ROOT_WITHOUT, False, False), ([], True, True),
                                          (OTHER_WITH, True, True)):
                said = await anyio.to_thread.run_sync(ask, flags)
                assert bool(said["cap_eff"] >> CAP_DAC_OVERRIDE & 1) is has_it
                assert said["kernel"] is kernel
                assert [r.get("result") for r in said["replies"]] == [kernel, kernel], (
                    flags, said)


@needs_root_and_setpriv
async def test_the_peers_capabilities_are_read_once_and_only_for_this_probe(
    node_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other requests read nothing of the peer's; vfio-group-accessible reads its status at
    the connection's first such request and keeps it for the connection."""
    from gpuwatch.service import server

    reads: list[int] = []

    def counted(peer: PeerCred, proc: str = "/proc") -> bool | None:
        reads.append(peer.pid)
        return peer_dac_override(peer, proc)

    monkeypatch.setattr(server, "peer_dac_override", counted)
    ask = {"action": "vfio-group-accessible", "group": GROUP}
    with short_socket_dir() as sockdir:
        path = f"{sockdir}/gw.sock"
        async with served_watcher(node_root, path):

            def exchange(*requests: dict[str, Any]) -> list[Any]:
                with socket.socket(socket.AF_UNIX) as sock:
                    sock.settimeout(10)
                    sock.connect(path)
                    reader = sock.makefile("rb")
                    replies = []
                    for rid, params in enumerate(requests):
                        sock.sendall(P.encode_request(rid, "probe", params))
                        replies.append(json.loads(reader.readline())["result"])
                    return replies

            others = ({"action": "detect-gpu"}, {"action": "memlock"},
                      {"action": "vfio-group-accessible", "group": GROUP + 1})  # no node
            await anyio.to_thread.run_sync(lambda: exchange(*others))
            assert reads == []
            said = await anyio.to_thread.run_sync(lambda: exchange(ask, *others, ask, ask))
            assert said[0] is said[-1] is True and reads == [os.getpid()]
            await anyio.to_thread.run_sync(lambda: exchange(ask))
            assert reads == [os.getpid()] * 2  # a new connection reads again


# ------------------------------------------------------------------ the peer's side


def _spawn(*argv: str) -> subprocess.Popen[bytes]:
    """A process to judge; returns once it has exec'd (its status shows its own name)."""
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{proc.pid}/comm").read_text().strip() == "sleep":
                return proc
        except OSError:
            pass
        time.sleep(0.01)
    proc.kill()
    raise AssertionError(f"{argv} did not start")


def _peer(proc: subprocess.Popen[bytes], uid: int) -> PeerCred:
    return PeerCred(pid=proc.pid, uid=uid, gid=uid, groups=frozenset({uid}),
                    start=process_start(proc.pid))


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None
                    or not (procfs.own_dac_override() or False),
                    reason="needs root with CAP_DAC_OVERRIDE and unshare")
def test_a_peers_override_counts_only_in_our_user_namespace() -> None:
    """A peer root in a user namespace of its own holds every capability there, none over
    our files: a peer we see as another uid gets no override from it; one in ours does; a
    pid that names another process now is not known (the rule as it was, for its uid)."""
    here = _spawn("sleep", "30")
    try:
        apart = _spawn("unshare", "--user", "--map-root-user", "sleep", "30")
    except AssertionError:
        here.kill()
        here.wait()
        pytest.skip("this kernel lets no one make a user namespace")
    try:
        full = effective_capabilities(apart.pid)
        assert full is not None and dac_override(full)  # root in its own namespace
        assert not in_our_user_namespace(apart.pid) and in_our_user_namespace(here.pid)
        assert peer_dac_override(_peer(apart, OTHER)) is False
        assert peer_dac_override(_peer(here, OTHER)) is True
        assert peer_dac_override(_peer(here, 0)) is True
        gone = _peer(here, OTHER)
        assert gone.start is not None  # the pid now names a process that started later:
        reused = PeerCred(pid=here.pid, uid=OTHER, gid=OTHER, groups=frozenset({OTHER}),
                          start=gone.start - 1)  # its capabilities are not the peer's
        assert peer_dac_override(reused) is None
    finally:
        for proc in (here, apart):
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert peer_dac_override(gone) is None
    assert peer_dac_override(PeerCred(pid=0, uid=0, gid=0, groups=frozenset())) is None
