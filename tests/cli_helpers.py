"""Running the ``gpuwatch`` CLI in-process: from sync tests, and from async tests (a daemon
serves on the same loop)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from gpuwatch.cli import fast_report
from gpuwatch.cli.main import main
from gpuwatch.service.testing import served_watcher, short_socket_dir
from gpuwatch.switch import hostops
from gpuwatch.switch.hostops import Backend
from gpuwatch.testing import SysRoot
from gpuwatch.testing.simkernel import SimKernel


async def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of one command, run in a worker thread so the event
    loop (and any daemon on it) keeps answering."""

    def call() -> int:
        try:
            return main(list(argv))
        except SystemExit as exc:
            return int(exc.code or 0)

    code = await anyio.to_thread.run_sync(call)
    out, err = capsys.readouterr()
    return code, out, err


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of one command run in this thread (no loop needed)."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse exits for its own errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


Run = Callable[..., tuple[int, str, str]]


def simulated_cli(s: SysRoot, monkeypatch: pytest.MonkeyPatch,
                  capsys: pytest.CaptureFixture[str], *, euid: int = 0,
                  sim: SimKernel | None = None) -> tuple[Run, SimKernel]:
    """The CLI on ``s`` (``--root`` added) with the simulated kernel behind every host
    write and command, as user ``euid``: no command ever reaches the real host."""
    kernel = sim or SimKernel(s)

    def backend(root: str) -> Backend:
        assert Path(root).resolve() == s.root.resolve()  # never the real host
        return Backend(kernel, kernel.new_source(), lambda: euid)

    monkeypatch.setattr(hostops, "backend_factory", backend)

    def run(*argv: str) -> tuple[int, str, str]:
        return run_main(capsys, *argv, "--root", str(s.root))

    return run, kernel


@dataclass(frozen=True)
class Reports:
    """What `list --json`, `status --json` and (when asked) `list` said of a root one way:
    ``where`` the daemon arguments, ``full`` the full command (else the stdlib report)."""

    where: tuple[str, ...]
    full: bool
    listed: list[dict[str, Any]]
    status: dict[str, Any]
    text: str | None


async def reports_every_way(capsys: pytest.CaptureFixture[str],
                            monkeypatch: pytest.MonkeyPatch, root: str, *,
                            text: bool = False) -> list[Reports]:
    """`list --json`, `status --json` and (``text``) `list` of ``root`` every way a command
    answers: no daemon for a fixture root (the stdlib's one scan), none asked for
    (``--no-daemon``) and a daemon's answers (``--socket``), each by the stdlib report and
    by the full command (the model, or `RemoteModel`). Each exits 0, stderr empty."""
    said: list[Reports] = []
    with short_socket_dir() as sockdir:
        sock = f"{sockdir}/gw.sock"
        async with served_watcher(root, sock):
            for where in ((), ("--no-daemon",), ("--socket", sock)):
                for full in (False, True):
                    with monkeypatch.context() as m:
                        if full:  # the full commands (the model, or RemoteModel)
                            m.setattr(fast_report, "run_report", lambda argv: None)
                        code, listed, err = await run_cli(capsys, "list", "--json", "--root",
                                                          root, *where)
                        assert (code, err) == (0, ""), (where, full)
                        code, status, err = await run_cli(capsys, "status", "--json",
                                                          "--root", root, *where)
                        assert (code, err) == (0, ""), (where, full)
                        listing = None
                        if text:
                            code, listing, err = await run_cli(capsys, "list", "--root",
                                                               root, *where)
                            assert (code, err) == (0, ""), (where, full)
                    said.append(Reports(where, full, json.loads(listed), json.loads(status),
                                        listing))
    return said
