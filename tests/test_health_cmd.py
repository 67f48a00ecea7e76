"""``gpuwatch health``: the probe command of the container's readiness and liveness checks."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from cli_helpers import run_cli

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
