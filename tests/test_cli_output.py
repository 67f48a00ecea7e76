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


#: A process names itself (``prctl``): outside ASCII and Latin-1 both.
ODD_COMM = "Xörg\u202e\u65e5"
#: What prints a name the host chose: JSON (the fast paths, the full commands, the log) and
#: text.
NAMING = (["probe", "nvidia-holders"], ["probe", "nvidia-holders", "--fresh"],
          ["holders", "--json"], ["plan", "vfio", "--json"], ["holders"], ["plan", "vfio"])


@pytest.fixture
def named_host(host: SysRoot) -> SysRoot:
    host.add_module("nvidia")
    host.add_cdi_spec()
    host.add_process(77, ODD_COMM, fds={3: "/dev/nvidia0"})
    return host


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_a_stdout_that_cannot_encode_a_name_still_gets_the_answer(
        named_host: SysRoot, encoding: str, tmp_path: Path) -> None:
    """``PYTHONIOENCODING=ascii`` (or a Latin-1 locale) and a process whose name it cannot
    encode: JSON is UTF-8 whatever the locale (RFC 8259), byte for byte what a UTF-8 stdout
    gets; text escapes what the encoding cannot say. Was: an internal error, exit 1."""
    log = tmp_path / "events.jsonl"
    stored = ('{"seq":1,"time":"t","type":"ready","reason":"' + ODD_COMM + '"}\n').encode()
    log.write_bytes(stored)
    for words in [*NAMING, ["events", str(log)]]:
        argv = gpuwatch_cmd(*words) if words[0] == "events" else _argv(named_host, words)
        utf8 = subprocess.run(argv, capture_output=True, env={**env(), "PYTHONIOENCODING":
                                                             "utf-8"}, timeout=60)
        other = subprocess.run(argv, capture_output=True, env={**env(), "PYTHONIOENCODING":
                                                              encoding}, timeout=60)
        assert b"internal error" not in other.stderr, (words, other.stderr)
        assert other.returncode == utf8.returncode, (words, other.stderr)
        assert other.stderr.count(b"\n") == utf8.stderr.count(b"\n"), (words, other.stderr)
        if "--json" in words or words[0] in ("probe", "events"):
            assert other.stdout == utf8.stdout, words
        else:
            other.stdout.decode(encoding)  # all of it said in the encoding
            assert b"X\\xf6rg" in other.stdout if encoding == "ascii" else \
                "Xörg".encode(encoding) in other.stdout, words
        if words[0] == "events":
            assert other.stdout == stored
        elif "--json" in words or words[0] == "probe":
            assert ODD_COMM.encode() in other.stdout, words


def test_main_gives_an_embedding_programs_stdout_back_as_it_was(
        named_host: SysRoot, monkeypatch: pytest.MonkeyPatch) -> None:
    """`main` in a program whose stdout is ASCII: the answer goes out as UTF-8 JSON, and the
    stream keeps its own encoding afterwards."""
    import io
    import json

    from gpuwatch.cli.main import main

    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="ascii", errors="strict")
    monkeypatch.setattr("sys.stdout", out)
    assert main(["probe", "nvidia-holders", "--root", str(named_host.root)]) == 0
    out.flush()
    assert json.loads(raw.getvalue().decode())["result"][0]["comm"] == ODD_COMM
    assert (out.encoding, out.errors) == ("ascii", "strict")


def _no_reader(argv: list[str], extra_env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess[str]:
    """``argv`` writing to a pipe whose reader is gone before it starts (``| true``, or
    ``| grep -q`` that found its line): every write is EPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(argv, stdout=write_end, stderr=subprocess.PIPE, text=True,
                              env={**env(), **(extra_env or {})}, timeout=60)
    finally:
        os.close(write_end)


REFUSED = ("gpuwatch: the switch would be refused: the card is in use: Xorg (pid 77) holds "
           "/dev/nvidia0; close them and retry (gpuwatch never kills them)\n")


@pytest.fixture
def held_host(host: SysRoot) -> SysRoot:
    """The example host with its GPU held open: ``plan vfio`` would be refused."""
    host.add_module("nvidia")
    host.add_cdi_spec()
    host.add_process(77, "Xorg", fds={3: "/dev/nvidia0"})
    return host


@pytest.mark.parametrize("words", [["plan", "vfio"], ["plan", "vfio", "--json"]], ids=" ".join)
def test_a_reader_that_left_takes_no_refusal_with_it(held_host: SysRoot,
                                                     words: list[str]) -> None:
    """A plan's status is its verdict: ``gpuwatch plan vfio | grep -q …`` (a reader that
    leaves) still exits 1 with the refusal's line, as ``> /dev/null`` does. Was: exit 0 and
    not a word, a refused switch reading as a safe one."""
    done = _no_reader(_argv(held_host, words))
    assert (done.returncode, done.stderr) == (1, REFUSED)


@pytest.mark.parametrize("words", [["plan", "vfio"], ["plan", "vfio", "--json"]], ids=" ".join)
def test_a_reader_that_left_takes_no_refusal_with_it_on_the_fast_path(
        held_host: SysRoot, words: list[str], tmp_path: Path) -> None:
    """The same through a daemon (the stdlib path prints the daemon's plan)."""
    from daemon_helpers import Daemon

    from gpuwatch.service.testing import short_socket_dir

    with short_socket_dir() as sockdir:
        sock = f"{sockdir}/gw.sock"
        work = tmp_path / "daemon"
        work.mkdir()
        with Daemon(held_host.root, work, sock):
            done = _no_reader([*_argv(held_host, words), "--socket", sock])
            with_reader = subprocess.run([*_argv(held_host, words), "--socket", sock],
                                         capture_output=True, text=True, env=env(), timeout=60)
    assert (with_reader.returncode, with_reader.stderr) == (1, REFUSED)
    assert (done.returncode, done.stderr) == (1, REFUSED)


def test_ensure_cdi_that_failed_says_so_to_a_reader_that_left(host: SysRoot,
                                                              tmp_path: Path) -> None:
    """``ensure-cdi --json`` prints its outcome, then exits 1 when there is no spec and no
    way to make one: a reader gone before the JSON takes none of that with it."""
    from gpuwatch.testing.simkernel import SIMKERNEL_ENV, SimKernel, save_for_subprocess

    host.remove_cdi_spec()
    saved = tmp_path / "simkernel.pickle"
    save_for_subprocess(SimKernel(host, tools=("modprobe",)), saved)
    argv = _argv(host, ["ensure-cdi", "--json"])
    with_reader = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                                 env={**env(), SIMKERNEL_ENV: str(saved)})
    assert with_reader.returncode == 1 and '"ok":false' in with_reader.stdout
    done = _no_reader(argv, {SIMKERNEL_ENV: str(saved)})
    assert (done.returncode, done.stderr) == (1, with_reader.stderr)
    assert done.stderr.startswith("gpuwatch: ") and done.stderr.count("\n") == 1
