"""Running the ``gpuwatch`` CLI in-process: from sync tests, and from async tests (a daemon
serves on the same loop)."""

from __future__ import annotations

import anyio
import pytest

from gpuwatch.cli.main import main


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
