"""The CLI against a daemon that answers badly: garbage, NaN, a duplicate key, nesting deep
enough to overflow a recursive parser, a lone surrogate, silence, a trickle, half a line.

docs/socket.md ("The CLI and the daemon"): a daemon that does not answer within 10 s, or
does not speak the protocol, means a direct scan. So every such command prints exactly
what ``--no-daemon`` prints, exit 0, nothing on stderr: never a traceback, never invalid
JSON on stdout, and never more than one wait on the daemon. A real unix socket served by a
thread plays the daemon; the command runs in this process so the wait can be shortened.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_helpers import run_main

from gpuwatch.cli import fast
from gpuwatch.service.testing import short_socket_dir
from gpuwatch.testing import SysRoot

pytestmark = pytest.mark.timeout(120)

GARBAGE = {
    "not-json": b"hello world\n",
    "nan": b'{"id":1,"result":NaN}\n',
    "infinity": b'{"id":1,"result":{"iommu_enabled":Infinity}}\n',
    "duplicate-key": b'{"id":1,"result":1,"result":true}\n',
    "deep": b'{"id":1,"result":' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
    "lone-surrogate": b'{"id":1,"result":"\\ud800"}\n',
    "not-utf8": b'{"id":1,"result":"\xff"}\n',
    "closed": b"",
}


class FakeDaemon:
    """A unix socket that reads each request line and answers ``reply(n)`` for the n-th
    connection: bytes to send at once, or an iterator of chunks sent a while apart."""

    def __init__(self, path: str, reply: bytes | str) -> None:
        self.path, self.reply = path, reply
        self.connections = 0
        self.stop = threading.Event()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(16)
        self.listener.settimeout(0.1)
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> FakeDaemon:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.listener.close()

    def _serve(self) -> None:
        held: list[socket.socket] = []
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            self.connections += 1
            held.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()
        for conn in held:
            conn.close()

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        data = b""
        try:
            while b"\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            if self.reply == "silent":
                self.stop.wait(60)
            elif self.reply == "half-line":
                conn.sendall(b'{"id":1,"res')
                self.stop.wait(60)
            elif self.reply == "trickle":  # a byte now and then, never a whole line
                while not self.stop.wait(0.05):
                    conn.sendall(b" ")
            elif isinstance(self.reply, bytes):
                conn.sendall(self.reply)
                if not self.reply:
                    conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


@pytest.fixture
def sock() -> Iterator[str]:
    with short_socket_dir() as path:
        yield f"{path}/gw.sock"


def direct(capsys: pytest.CaptureFixture[str], words: list[str]) -> tuple[int, str, str]:
    return run_main(capsys, *words, "--no-daemon")


COMMANDS = (["probe", "detect-gpu"], ["probe", "detect-vfio"], ["status"], ["status", "--json"],
            ["list"], ["holders"], ["holders", "--json"], ["plan", "vfio", "--json"])


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_a_daemon_that_answers_garbage_means_a_direct_scan(
        host: SysRoot, sock: str, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    root = ["--root", str(host.root)]
    with FakeDaemon(sock, GARBAGE[kind]) as daemon:
        for words in COMMANDS:
            got = run_main(capsys, *words, *root, "--socket", sock)
            assert got == direct(capsys, [*words, *root]), (kind, words)
            assert got[0] == 0 and got[2] == ""
        assert daemon.connections >= len(COMMANDS)  # each one did ask


@pytest.mark.parametrize("kind", ["silent", "half-line", "trickle"])
def test_a_daemon_that_does_not_answer_in_time_is_waited_on_once(
        host: SysRoot, sock: str, kind: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One bounded wait for the whole answer (a trickle of bytes does not reset it), then
    the direct scan: the full command does not ask the same daemon again."""
    monkeypatch.setattr(fast, "TIMEOUT", 0.5)
    root = ["--root", str(host.root)]
    for words in (["probe", "detect-vfio"], ["status", "--json"], ["holders"], ["plan", "vfio"]):
        with FakeDaemon(sock, kind) as daemon:
            got = run_main(capsys, *words, *root, "--socket", sock)
            asked = daemon.connections
        Path(sock).unlink()
        assert got == direct(capsys, [*words, *root]), (kind, words)
        assert asked == 1, (kind, words)


def test_a_reply_that_never_ends_is_given_up_on(sock: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`ask` itself: a daemon that keeps sending bytes of a line that never ends is given
    up on within the bound, whatever the gaps between its bytes, and remembered."""
    monkeypatch.setattr(fast, "TIMEOUT", 0.5)
    monkeypatch.setattr(fast, "UNANSWERED", set())
    with FakeDaemon(sock, "trickle"), pytest.raises(TimeoutError):
        fast.ask(sock, "probe", {"action": "detect-gpu"})
    assert {sock} == fast.UNANSWERED


#: JSON in the protocol's envelope whose result has no shape gpuwatch answers.
WRONG_SHAPE = {
    "holders-not-a-list": b'{"id":1,"result":{"holders":"xy","addr":"0000:01:00.0",'
                          b'"group":13,"note":""}}\n',
    "plan-member-not-an-object": b'{"id":1,"result":{"addr":"a","group":1,"from_mode":"nvidia",'
                                 b'"to_mode":"vfio","example":false,"members":[1],'
                                 b'"refused":null,"steps":[],"notes":[]}}\n',
    "gpu-without-fields": b'{"id":1,"result":{"iommu_enabled":true,"gpus":[{"addr":5}]}}\n',
    "a-string": b'{"id":1,"result":"\\u001b[2J"}\n',
}


@pytest.mark.parametrize("kind", sorted(WRONG_SHAPE))
def test_a_reply_in_no_shape_gpuwatch_answers_means_a_direct_scan(
        host: SysRoot, sock: str, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Reports built from the daemon's answers (status, list, holders, plan) check what
    they read, and a probe its action's shape (tests/test_cli_probe_shapes.py): a foreign or
    hostile socket is as a daemon that does not speak the protocol, not a traceback half-way
    through printing, nor its answer printed as the host's."""
    root = ["--root", str(host.root)]
    with FakeDaemon(sock, WRONG_SHAPE[kind]):
        for words in COMMANDS:
            got = run_main(capsys, *words, *root, "--socket", sock)
            assert got == direct(capsys, [*words, *root]), (kind, words)


@pytest.mark.parametrize("words", [["probe", "detect-gpu"], ["status"], ["holders"],
                                   ["plan", "vfio"]], ids=" ".join)
def test_ctrl_c_while_a_daemon_keeps_silent_is_exit_130_without_a_traceback(
        host: SysRoot, sock: str, words: list[str]) -> None:
    """The fast paths wait up to 10 s on a daemon before any command runs: SIGINT then is
    128 + 2 and nothing on stderr, as inside a command (was: a KeyboardInterrupt traceback)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    env["PYTHONPATH"] = str(repo)
    with FakeDaemon(sock, "silent") as daemon:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuwatch", *words, "--root", str(host.root), "--socket",
             sock], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            cwd=repo)
        try:
            deadline = time.monotonic() + 60
            while daemon.connections < 1:  # it asked, and waits for the answer
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.01)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert (proc.returncode, out, err) == (130, "", "")
