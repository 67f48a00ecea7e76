"""With a daemon up or not, a command says the same bytes: stdout, stderr and exit code.

A real ``gpuwatch watch --socket`` process over a fixture root answers through the fast
stdlib path and the full commands alike; the same command lines run with no daemon at all
(the direct scan) must print exactly the same, errors included (docs/socket.md, "The CLI
and the daemon").
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_helpers import Daemon, env, gpuwatch_cmd

from gpuwatch.service.testing import short_socket_dir
from gpuwatch.testing import SysRoot

pytestmark = pytest.mark.timeout(300)

MISSING = "0000:09:00.0"
COMMANDS = [
    ["probe", "detect-vfio"],
    ["probe", "group-in-mode", "--addr", "0000:01:00.0", "--mode", "vfio"],
    ["probe", "group-in-mode", "--addr", MISSING, "--mode", "vfio"],
    ["probe", "current-mode", "--addr", MISSING],
    ["probe", "display-driver", "--addr", MISSING],
    ["probe", "vfio-group-accessible", "--group", "99999999999999999999"],
    ["probe", "bogus"],
    ["status", "--json"],
    ["list"],
    ["holders"],
    ["holders", "--addr", MISSING],
    ["holders", "--vendor", "0x1002"],
    ["holders", "--addr", "zz"],
    ["plan", "vfio", "--json"],
    ["plan", "vfio", "--addr", MISSING],
    ["plan", "nvidia", "--vendor", "0x1002"],
    ["mode"],
    ["mode", "--addr", MISSING],
    ["mode", "--vendor", "0x1002", "--json"],
]


@pytest.fixture
def served(host: SysRoot, tmp_path: Path) -> Iterator[tuple[SysRoot, str]]:
    with short_socket_dir() as sockdir:
        sock = f"{sockdir}/gw.sock"
        work = tmp_path / "daemon"
        work.mkdir()
        with Daemon(host.root, work, sock):
            yield host, sock


def run(argv: list[str]) -> tuple[int, str, str]:
    done = subprocess.run(gpuwatch_cmd(*argv), capture_output=True, text=True, env=env(),
                          timeout=60)
    return done.returncode, done.stdout, done.stderr


def test_every_command_says_the_same_with_a_daemon_and_without(
        served: tuple[SysRoot, str]) -> None:
    host, sock = served
    root = ["--root", str(host.root)]
    for words in COMMANDS:
        with_daemon = run([*words, *root, "--socket", sock])
        without = run([*words, *root])  # a fixture root: the host's daemon is never asked
        assert with_daemon == without, words
        assert "daemon" not in with_daemon[2], words
    assert os.path.exists(sock)  # it was there all along
