"""Where the CLI's output goes wrong: stdout closed, stdout a full disk, a reader that leaves.

Each is one line on stderr and a documented exit (docs/probes.md "Exit codes and errors"):
a closed stdout is a usage error (2) found before anything runs, a write that fails is 1
naming the failure, a reader that leaves early (``| head``) is no error. Real child
processes with real file descriptors: the fast paths and the full commands alike.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from daemon_helpers import env, gpuwatch_cmd

from gpuwatch.testing import SysRoot

pytestmark = pytest.mark.timeout(120)

#: The fast path (probe, status, list: a direct scan with the stdlib) and the full commands.
COMMANDS = (
    ["probe", "detect-vfio"],
    ["probe", "detect-vfio", "--fresh"],
    ["status"],
    ["list", "--json"],
    ["holders"],
    ["plan", "vfio"],
    ["mode", "--json"],
    ["udev-rules"],
)


def _argv(host: SysRoot, words: list[str]) -> list[str]:
    return gpuwatch_cmd(*words, *([] if words[0] == "udev-rules" else ["--root", str(host.root)]))


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("words", COMMANDS, ids=" ".join)
def test_a_full_disk_on_stdout_is_one_line_and_exit_1(host: SysRoot, words: list[str]) -> None:
    with open("/dev/full", "w") as full:
        done = subprocess.run(_argv(host, words), stdout=full, stderr=subprocess.PIPE,
                              text=True, env=env(), timeout=60)
    assert done.returncode == 1, done.stderr
    last = done.stderr.splitlines()[-1]
    assert last == "gpuwatch: cannot write stdout: No space left on device"
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr


@pytest.mark.parametrize("words", COMMANDS, ids=" ".join)
def test_a_closed_stdout_is_refused_before_anything_runs(host: SysRoot,
                                                         words: list[str]) -> None:
    done = subprocess.run(_argv(host, words), stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, env=env(), timeout=60,
                          preexec_fn=lambda: os.close(1))
    assert (done.returncode, done.stderr) == (
        2, "gpuwatch: stdout is closed: redirect it to a file or /dev/null\n")


def test_help_and_version_need_no_stdout(host: SysRoot) -> None:
    """argparse writes help to stderr when stdout is closed: that stays an answer."""
    for words in (["--help"], ["probe", "--help"], ["--version"]):
        done = subprocess.run(gpuwatch_cmd(*words), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env=env(), timeout=60,
                              preexec_fn=lambda: os.close(1))
        assert done.returncode == 0 and "gpuwatch" in done.stderr, (words, done.stderr)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_help_on_a_full_disk_says_so(tmp_path: Path) -> None:
    with open("/dev/full", "w") as full:
        done = subprocess.run(gpuwatch_cmd("--help"), stdout=full, stderr=subprocess.PIPE,
                              text=True, env=env(), timeout=60)
    assert (done.returncode, done.stderr) == (
        1, "gpuwatch: cannot write stdout: No space left on device\n")


@pytest.mark.parametrize("words", COMMANDS, ids=" ".join)
def test_a_reader_that_leaves_early_is_no_error(host: SysRoot, words: list[str]) -> None:
    child = subprocess.Popen(_argv(host, words), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env())
    assert child.stdout is not None and child.stderr is not None
    child.stdout.read(1)
    child.stdout.close()  # as `| head -c1` does
    with child.stderr:
        err = child.stderr.read().decode()
    assert child.wait(timeout=60) == 0, err
    assert "Traceback" not in err and "Exception ignored" not in err
