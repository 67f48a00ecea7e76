"""Running the ``gpuwatch`` CLI in-process: from sync tests, and from async tests (a daemon
serves on the same loop)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from gpuwatch.cli.main import main
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
