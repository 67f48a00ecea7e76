"""The daemon's life as systemd and Kubernetes drive it, each against a real process: the
notify protocol on a socket this test holds (one nobody reads, one that is not there, an
abstract one), a second stop signal while the run ends, the unit's runtime directory, and
`gpuwatch health` against a daemon that cannot answer."""

from __future__ import annotations

import configparser
import contextlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from daemon_helpers import REPO, Daemon, env, gpuwatch_cmd, probe

from gpuwatch.service.notify import Notifier
from gpuwatch.service.testing import short_socket_dir
from gpuwatch.testing import SysRoot

UNIT = REPO / "contrib/systemd/gpuwatch.service"


@pytest.fixture
def sockdir() -> Iterator[str]:
    with short_socket_dir() as path:
        yield path


def datagrams(sock: socket.socket) -> list[str]:
    """Every state queued on the notify socket now."""
    out = []
    sock.setblocking(False)
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except BlockingIOError:
            return out


def notify_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "sd_notify" in line]


# --------------------------------------------------------------------------- notify protocol


@pytest.mark.timeout(60)
def test_a_notify_socket_nobody_reads_neither_stalls_nor_floods_the_daemon(
    host: SysRoot, tmp_path: Path, sockdir: str
) -> None:
    """systemd busy (its queue full): a ping must be dropped, not wait in the event loop,
    which would leave clients unanswered and SIGTERM unable to stop the daemon."""
    qlen = int(Path("/proc/sys/net/unix/max_dgram_qlen").read_text())
    if qlen > 200:
        pytest.skip(f"net.unix.max_dgram_qlen {qlen}: the queue would not fill in time")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(f"{sockdir}/notify")
    daemon = Daemon(host.root, tmp_path, f"{sockdir}/gw.sock",
                    environ={"NOTIFY_SOCKET": f"{sockdir}/notify", "WATCHDOG_USEC": "2000"})
    try:
        daemon.start()
        time.sleep(0.5)  # pings every millisecond: the queue is full long before this
        started = time.monotonic()
        assert "result" in probe(daemon.sock)
        assert time.monotonic() - started < 5
        assert daemon.stop(timeout=10) == 0, daemon.stderr
    finally:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.stop()
        got = datagrams(notify)
        notify.close()
    assert got[0].startswith("READY=1\nSTATUS=watching"), got
    assert daemon.events()[-1]["type"] == "stopped"
    assert not os.path.exists(daemon.sock)
    # Said once for the whole run, not once per refused ping.
    assert len(notify_lines(daemon.stderr)) == 1, daemon.stderr


@pytest.mark.timeout(60)
def test_ready_waits_a_moment_for_room_in_a_notify_queue_full_at_boot(
    host: SysRoot, tmp_path: Path, sockdir: str
) -> None:
    """systemd busy at boot: its notify queue full as the daemon gets ready. A ping may be
    dropped, but READY=1 waits for room (a bounded while): dropped, systemd would time the
    start out and restart a daemon that was serving."""
    qlen = int(Path("/proc/sys/net/unix/max_dgram_qlen").read_text())
    if qlen > 200:
        pytest.skip(f"net.unix.max_dgram_qlen {qlen}: too long a queue to fill here")
    path = f"{sockdir}/notify"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(path)
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
    queued = 0
    with contextlib.suppress(BlockingIOError):
        while queued < 10_000:
            filler.sendto(b"X=other-unit", path)
            queued += 1
    filler.close()
    got: list[str] = []

    def drain_later() -> None:  # systemd gets round to its queue once READY=1 is due
        deadline = time.monotonic() + 20
        while not os.path.exists(f"{sockdir}/gw.sock") and time.monotonic() < deadline:
            time.sleep(0.01)  # READY=1 goes out as soon as the socket listens
        time.sleep(0.3)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(g.startswith("READY=1") for g in got):
            got.extend(datagrams(notify))
            time.sleep(0.05)

    drainer = threading.Thread(target=drain_later, daemon=True)
    drainer.start()
    with Daemon(host.root, tmp_path, f"{sockdir}/gw.sock",
                environ={"NOTIFY_SOCKET": path}) as d:
        drainer.join(15)
        assert "result" in probe(d.sock)
    notify.close()
    assert [g.split("\n")[0] for g in got if not g.startswith("X=")][:1] == ["READY=1"], got
    assert notify_lines(d.stderr) == [], d.stderr


@pytest.mark.timeout(60)
def test_a_notify_socket_that_points_nowhere_is_said_once_and_the_daemon_runs(
    host: SysRoot, tmp_path: Path, sockdir: str
) -> None:
    with Daemon(host.root, tmp_path, f"{sockdir}/gw.sock",
                environ={"NOTIFY_SOCKET": f"{sockdir}/nobody", "WATCHDOG_USEC": "2000"}) as d:
        time.sleep(0.3)
        assert "result" in probe(d.sock)
    assert d.proc is not None and d.proc.returncode == 0, d.stderr
    lines = notify_lines(d.stderr)
    assert len(lines) == 1 and "READY=1" in lines[0], d.stderr


@pytest.mark.timeout(60)
def test_an_abstract_notify_socket_gets_ready_and_stopping_and_another_pids_watchdog_none(
    host: SysRoot, tmp_path: Path, sockdir: str
) -> None:
    name = f"gpuwatch-life-{os.getpid()}"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind("\0" + name)
    try:
        daemon = Daemon(host.root, tmp_path, f"{sockdir}/gw.sock",
                        environ={"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "20000",
                                 "WATCHDOG_PID": "1"}).start()
        time.sleep(0.3)  # 30 pings' worth, had the watchdog been this process's
        assert daemon.stop() == 0, daemon.stderr
        got = datagrams(notify)
    finally:
        notify.close()
    assert got[0].startswith("READY=1\nSTATUS="), got
    assert got[-1] == "STOPPING=1", got
    assert "WATCHDOG=1" not in got


@pytest.mark.timeout(30)
def test_the_watchdog_goes_quiet_while_the_event_loop_is_blocked(sockdir: str) -> None:
    """The pings come from the loop itself: a loop stuck in a blocking call sends none."""
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(f"{sockdir}/notify")
    notifier = Notifier({"NOTIFY_SOCKET": f"{sockdir}/notify", "WATCHDOG_USEC": "20000"})

    async def main() -> tuple[int, int]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(notifier.run_watchdog)
            await anyio.sleep(0.1)
            datagrams(notify)
            time.sleep(0.3)  # the loop blocked: 30 pings' worth
            during = len(datagrams(notify))
            await anyio.sleep(0.1)
            after = len(datagrams(notify))
            tg.cancel_scope.cancel()
        return during, after

    try:
        during, after = anyio.run(main)
    finally:
        notify.close()
    assert during <= 1 and after >= 2, (during, after)


@pytest.mark.timeout(30)
def test_a_failing_notify_socket_is_said_once_and_its_recovery_too(
    sockdir: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = f"{sockdir}/notify"
    notifier = Notifier({"NOTIFY_SOCKET": path})
    with caplog.at_level(logging.WARNING, logger="gpuwatch.service"):
        assert not notifier.ready() and not notifier.status("a") and not notifier.status("b")
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(path)
        try:
            assert notifier.status("c") and notifier.stopping()
            assert datagrams(notify) == ["STATUS=c", "STOPPING=1"]
        finally:
            notify.close()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "READY=1" in said[0] and "works again" in said[1], said


# --------------------------------------------------------------------------- signals


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_while_the_stdout_log_drains_still_exits_0_with_stopped_last(
    host: SysRoot, tmp_path: Path, sockdir: str, sig: int
) -> None:
    """``--log -`` gives its reader a second to take the ``stopped`` record: a second
    SIGTERM (or Ctrl-C) then must not kill the process by the signal and lose the record."""
    fifo, sock = tmp_path / "uevents", f"{sockdir}/gw.sock"
    os.mkfifo(fifo)
    reader, writer = os.pipe()
    os.set_blocking(writer, False)
    junk = 0
    try:
        while True:  # the reader has fallen behind: the pipe is full before the daemon starts
            junk += os.write(writer, b"x" * 4095 + b"\n")
    except BlockingIOError:
        pass
    os.set_blocking(writer, True)
    proc = subprocess.Popen(
        gpuwatch_cmd("watch", "--root", str(host.root), "--source", f"file:{fifo}",
                     "--log", "-", "--reconcile-interval", "0", "--socket", sock),
        stdout=writer, stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO)
    os.close(writer)
    source = os.open(fifo, os.O_RDWR)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                probe(sock)
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.02)
        proc.send_signal(sig)
        while os.path.exists(sock):  # the run is ending: the log's close comes next
            assert time.monotonic() < deadline
            time.sleep(0.005)
        time.sleep(0.05)
        proc.send_signal(sig)
        with os.fdopen(reader, "rb") as out:
            lines = out.read()[junk:].splitlines()
        _, stderr = proc.communicate(timeout=10)
    finally:
        os.close(source)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert b'"type":"stopped"' in lines[-1], lines[-3:]


# --------------------------------------------------------------------------- the unit


def test_the_unit_keeps_its_runtime_directory_when_it_stops() -> None:
    """/run/gpuwatch holds the switch locks, which a `gpuwatch mode` run beside the service
    may hold while it stops; systemd's default removes the directory (and the locks)."""
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(UNIT.read_text())
    service = parser["Service"]
    assert service["RuntimeDirectory"] == "gpuwatch"
    assert service.get("RuntimeDirectoryPreserve") == "yes"
    assert "RuntimeDirectoryPreserve=yes" in (REPO / "docs/service.md").read_text()


# --------------------------------------------------------------------------- health probes


def health(path: str, timeout: float = 1.0) -> tuple[int, str, float]:
    started = time.monotonic()
    proc = subprocess.run(gpuwatch_cmd("health", "--socket", path, "--timeout", str(timeout)),
                          capture_output=True, text=True, env=env(), cwd=REPO, timeout=30)
    return proc.returncode, proc.stderr, time.monotonic() - started


@pytest.mark.timeout(60)
def test_health_fails_in_bounded_time_on_a_stopped_daemon_and_on_what_is_no_socket(
    host: SysRoot, tmp_path: Path, sockdir: str
) -> None:
    os.mkfifo(f"{sockdir}/fifo")
    Path(f"{sockdir}/file").write_text("")
    for path in (f"{sockdir}/fifo", f"{sockdir}/file", f"{sockdir}/none"):
        rc, stderr, took = health(path)
        assert rc == 1 and stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
        assert took < 10, (path, took)
    with Daemon(host.root, tmp_path, f"{sockdir}/gw.sock") as d:
        assert health(d.sock)[0] == 0
        assert d.proc is not None
        os.kill(d.proc.pid, signal.SIGSTOP)  # the kubelet's probe against a frozen daemon
        try:
            rc, stderr, took = health(d.sock, timeout=1.0)
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        assert rc == 1 and "did not answer within 1 s" in stderr and took < 10, (rc, stderr, took)
        assert health(d.sock)[0] == 0
