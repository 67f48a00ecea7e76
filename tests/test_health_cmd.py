"""``gpuwatch health``: the probe command of the container's readiness and liveness checks."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from cli_helpers import run_cli, run_main

from gpuwatch.service.testing import served_watcher, short_socket_dir
from gpuwatch.testing import SysRoot


@pytest.fixture
def sockdir() -> Iterator[str]:
    with short_socket_dir() as path:
        yield path


async def test_healthy_daemon_answers(
    host: SysRoot, sockdir: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = f"{sockdir}/gw.sock"
    async with served_watcher(host.root, path):
        code, out, err = await run_cli(capsys, "health", "--socket", path)
        assert (code, err) == (0, "")
        assert out.startswith(f"ok: the daemon at {path} answered in ")
        # As the pod runs it: the socket from the environment, nothing printed.
        monkeypatch.setenv("GPUWATCH_SOCKET", path)
        assert await run_cli(capsys, "health", "--quiet") == (0, "", "")


async def test_no_daemon_is_exit_1_in_one_line(
    sockdir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = await run_cli(capsys, "health", "--socket", f"{sockdir}/none.sock")
    assert (code, out) == (1, "")
    assert err.startswith("gpuwatch: health: no gpuwatch daemon at") and err.count("\n") == 1


async def test_a_stuck_daemon_fails_the_check(
    sockdir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Accepts connections (the process is there) but never answers: what liveness is for.
    path = f"{sockdir}/stuck.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    try:
        code, _, err = await run_cli(capsys, "health", "--socket", path, "--timeout", "0.5")
    finally:
        listener.close()
    assert code == 1 and "health:" in err and err.count("\n") == 1


def test_the_timeout_bounds_the_whole_check_connect_and_answer(
    sockdir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A daemon whose listen backlog is full takes the connect most of the timeout, then
    accepts and never answers: ``--timeout`` is the bound of the whole check, not of each
    step (the probe's own ``timeoutSeconds`` is set just above it; past it kubelet kills the
    check and logs no reason). The line says the daemon did not answer in time."""
    path = f"{sockdir}/slow.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(0)
    fillers: list[socket.socket] = []
    accepted: list[socket.socket] = []
    try:
        while True:  # fill the backlog: the next connect waits for room
            filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            filler.setblocking(False)
            try:
                filler.connect(path)
            except BlockingIOError:
                filler.close()
                break
            fillers.append(filler)
        listener.settimeout(2.0)  # the timer's accepts never hang the test

        def accept_all() -> None:
            with contextlib.suppress(OSError):
                for _ in range(len(fillers) + 1):  # the fillers, then the check's own
                    accepted.append(listener.accept()[0])

        timer = threading.Timer(0.8, accept_all)
        timer.start()
        start = time.monotonic()
        code, out, err = run_main(capsys, "health", "--socket", path, "--timeout", "1")
        took = time.monotonic() - start
        timer.join()
    finally:
        for s in (*fillers, *accepted, listener):
            s.close()
    assert (code, out) == (1, "")
    assert took < 1.5, f"the check took {took:.2f} s with --timeout 1"
    assert err == f"gpuwatch: health: the daemon at {path} did not answer within 1 s\n"
