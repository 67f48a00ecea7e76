"""Starting the daemon: two starts at once never both serve nor take each other's socket,
the lock beside the socket leaves nothing that blocks the next start, and a start that
cannot bind *yet* exits with a code of its own (systemd retries it; a bad configuration,
exit 2, it does not)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import Daemon, env, gpuwatch_cmd, probe

from gpuwatch.errors import EXIT_RETRY, EXIT_USAGE
from gpuwatch.service.server import (
    ListenerNotYet,
    SocketInUse,
    SocketSetupError,
    bind_socket,
    socket_lock_path,
)
from gpuwatch.service.testing import short_socket_dir
from gpuwatch.testing import SysRoot


@pytest.fixture
def sockdir() -> Iterator[str]:
    with short_socket_dir() as path:
        yield path


def _serves_path(listener: socket.socket, path: str) -> bool:
    """Whether a connect to ``path`` reaches ``listener`` (not another process's socket)."""
    with socket.socket(socket.AF_UNIX) as client:
        client.settimeout(2)
        try:
            client.connect(path)
        except OSError:
            return False
        readable, _, _ = select.select([listener], [], [], 2)
        if not readable:
            return False
        with contextlib.suppress(BlockingIOError):
            conn, _ = listener.accept()
            conn.close()
            return True
        return False


def _racer(path: str, rounds: int, barrier: Any, results: Any) -> None:
    """One of several processes binding ``path`` at the same moment, round after round.
    A winner checks that the path reaches *its* socket, then closes without removing the
    file: the next round starts from a stale socket, the case in which a start unlinks."""
    for round_ in range(rounds):
        barrier.wait()
        outcome = "lost"
        listener = None
        try:
            listener = bind_socket(path, None)
        except SocketInUse:
            pass
        except Exception as exc:  # anything else is a failure of its own
            outcome = f"{type(exc).__name__}: {exc}"
        barrier.wait()  # every racer has bound or given up
        if listener is not None:
            outcome = "won" if _serves_path(listener, path) else "won-unreachable"
        results.put((round_, outcome))  # a queue's order across processes is not the rounds
        barrier.wait()
        if listener is not None:
            listener.close()
        barrier.wait()


@pytest.mark.timeout(240)
def test_binders_racing_for_one_path_leave_exactly_one_serving(sockdir: str) -> None:
    """Processes binding one path at the same instant, a stale socket there each round.
    Without a lock, one that looked while another was between its bind and its listen took
    the bound socket for a dead one's, replaced it, and both went on "serving"."""
    path = f"{sockdir}/gw.sock"
    racers, rounds = 4, 150
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(racers, timeout=60)
    results = ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(path, rounds, barrier, results))
             for _ in range(racers)]
    for p in procs:
        p.start()
    per_round: dict[int, list[str]] = {}
    for _ in range(racers * rounds):
        round_, outcome = results.get(timeout=120)
        per_round.setdefault(round_, []).append(outcome)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sorted(per_round) == list(range(rounds))
    odd = [(n, r) for n, r in per_round.items()
           if sorted(r) != ["lost"] * (racers - 1) + ["won"]]
    assert odd == [], odd[:5]
    assert not os.path.exists(socket_lock_path(path))  # every holder removed it on close


def test_the_lock_held_by_a_starting_daemon_keeps_a_not_yet_listening_socket(
    sockdir: str,
) -> None:
    """The state the race left: a socket bound but not yet listening (a connect is refused,
    as for a dead daemon's) by a process that holds the lock. It is not taken."""
    path = f"{sockdir}/gw.sock"
    first = bind_socket(path, None)
    try:
        inode = os.stat(path).st_ino
        with pytest.raises(SocketInUse, match=rf"pid {os.getpid()}\b.*{path}\.lock"):
            bind_socket(path, None)
        assert os.stat(path).st_ino == inode
        assert _serves_path(first, path)
    finally:
        first.close()


def test_a_lock_left_by_a_killed_daemon_does_not_block_the_next(
    sockdir: str, tmp_path: Path
) -> None:
    path = f"{sockdir}/gw.sock"
    # A process that took the lock and the socket, then died by SIGKILL: both files stay.
    child = subprocess.Popen(
        [*gpuwatch_cmd()[:1], "-c", "import sys, signal, os; "
         "from gpuwatch.service.server import bind_socket; s = bind_socket(sys.argv[1], None); "
         "print('bound', flush=True); signal.pause()", path],
        stdout=subprocess.PIPE, text=True, env=env())
    try:
        assert child.stdout is not None and child.stdout.readline() == "bound\n"
    finally:
        child.kill()
        child.communicate(timeout=30)
    assert os.path.exists(path) and os.path.exists(socket_lock_path(path))
    again = bind_socket(path, None)
    try:
        assert _serves_path(again, path)
    finally:
        again.close()
    assert not os.path.exists(socket_lock_path(path))


@pytest.mark.parametrize("planted", ["symlink", "fifo", "directory"])
def test_a_lock_path_that_is_not_a_plain_file_is_left_alone(
    sockdir: str, tmp_path: Path, planted: str
) -> None:
    path = f"{sockdir}/gw.sock"
    lock = socket_lock_path(path)
    target = tmp_path / "precious"
    target.write_text("precious")
    if planted == "symlink":
        os.symlink(target, lock)
    elif planted == "fifo":
        os.mkfifo(lock)
    else:
        os.mkdir(lock)
    with pytest.raises(SocketSetupError) as caught:
        bind_socket(path, None)
    assert not isinstance(caught.value, ListenerNotYet)
    assert lock in str(caught.value) and "\n" not in str(caught.value)
    assert target.read_text() == "precious" and not os.path.exists(path)


@pytest.mark.timeout(300)
def test_two_daemons_started_together_leave_one_serving_and_the_other_exits_to_retry(
    host: SysRoot, tmp_path: Path, sockdir: str
) -> None:
    """Real daemons started at the same moment, round after round, the socket file left
    stale (SIGKILL) after each round: exactly one serves the path; the other exits with the
    retry code, one line, never having taken the winner's socket."""
    path = f"{sockdir}/gw.sock"
    deadline = time.monotonic() + 200
    rounds = 0
    while rounds < 8 and time.monotonic() < deadline:
        rounds += 1
        procs = []
        writers = []
        for name in ("a", "b"):
            log = tmp_path / f"{name}{rounds}.jsonl"
            fifo = tmp_path / f"{name}{rounds}.fifo"
            os.mkfifo(fifo)  # a source that stays open: the daemon runs until stopped
            writers.append(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
            procs.append(subprocess.Popen(
                gpuwatch_cmd("watch", "--root", str(host.root), "--source", f"file:{fifo}",
                             "--log", str(log), "--reconcile-interval", "0",
                             "--socket", path),
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env()))
        try:
            exited: list[subprocess.Popen[str]] = []
            limit = time.monotonic() + 60
            while not exited and time.monotonic() < limit:
                exited = [p for p in procs if p.poll() is not None]
                time.sleep(0.05)
            assert len(exited) == 1, f"round {rounds}: {[p.poll() for p in procs]}"
            loser = exited[0]
            winner = procs[1 - procs.index(loser)]
            err = loser.stderr.read() if loser.stderr else ""
            assert loser.returncode == EXIT_RETRY, err
            assert err.count("\n") == 1 and path in err and "Traceback" not in err, err
            answer: dict[str, Any] = {}
            while time.monotonic() < limit and "result" not in answer:
                with contextlib.suppress(OSError):
                    answer = probe(path)
                time.sleep(0.05)
            assert answer.get("result") is True
            assert winner.poll() is None  # the one that answers is the one still running
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
                p.communicate(timeout=30)
            for fd in writers:
                os.close(fd)
    assert rounds >= 3


@pytest.mark.parametrize("what", ["metrics", "socket-live"])
def test_a_listener_that_cannot_bind_yet_exits_with_the_retry_code(
    host: SysRoot, tmp_path: Path, sockdir: str, what: str
) -> None:
    """Address in use: the metrics port, or the socket of a daemon that still runs (as
    during a restart that overlaps the old one). Retried by systemd: exit 75, one line."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    args = ["--socket", f"{sockdir}/gw.sock"]
    live: Daemon | None = None
    if what == "metrics":
        args += ["--metrics", f"127.0.0.1:{taken.getsockname()[1]}"]
    else:
        (tmp_path / "one").mkdir()
        live = Daemon(host.root, tmp_path / "one", f"{sockdir}/gw.sock").start()
    try:
        proc = subprocess.run(
            gpuwatch_cmd("watch", "--root", str(host.root), "--source", "file:/dev/null",
                         "--log", str(tmp_path / "events.jsonl"), *args),
            capture_output=True, text=True, env=env(), timeout=60)
        assert proc.returncode == EXIT_RETRY, proc.stderr
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
        if live is not None:
            assert probe(live.sock)["result"] is True
    finally:
        taken.close()
        if live is not None:
            assert live.stop() == 0, live.stderr


def test_a_socket_path_that_cannot_work_stays_exit_2(host: SysRoot, tmp_path: Path) -> None:
    """A configuration to fix, not to retry: a file on the way to the socket."""
    (tmp_path / "file").write_text("")
    proc = subprocess.run(
        gpuwatch_cmd("watch", "--root", str(host.root), "--source", "file:/dev/null", "--log",
                     str(tmp_path / "events.jsonl"), "--socket",
                     str(tmp_path / "file" / "gw.sock")),
        capture_output=True, text=True, env=env(), timeout=60)
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_a_lock_left_by_another_users_daemon_does_not_block_this_one(sockdir: str) -> None:
    """Root's daemon, killed, left its lock (root's, 0644) in a directory now served by a
    daemon of another user: that one can still lock the file (flock needs no write access)."""
    path = f"{sockdir}/gw.sock"
    lock = socket_lock_path(path)
    with open(lock, "w") as f:
        f.write("1\n")
    os.chmod(lock, 0o644)
    os.chown(sockdir, 70010, 70010)
    script = ("import os, sys; from gpuwatch.service.server import bind_socket; "
              "os.setgroups([]); os.setgid(70010); os.setuid(70010); "
              "s = bind_socket(sys.argv[1], None); print('served'); s.close()")
    out = subprocess.run([*gpuwatch_cmd()[:1], "-c", script, path], capture_output=True,
                         text=True, env=env(), timeout=60)
    assert out.stdout == "served\n", out.stderr


def test_a_socket_path_with_bytes_that_are_not_utf8_is_served(sockdir: str) -> None:
    """A path is bytes: one that is not UTF-8 (as argv hands it over, surrogate-escaped) is
    bound, locked and let go like any other, not an internal error."""
    path = os.fsdecode(os.fsencode(sockdir) + b"/gw\xff.sock")
    listener = bind_socket(path, None)
    try:
        assert _serves_path(listener, path)
        assert os.path.exists(socket_lock_path(path))
    finally:
        listener.close()
    assert not os.path.exists(socket_lock_path(path))
