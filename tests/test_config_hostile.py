"""Config files a careless or hostile hand wrote: an alias bomb, options of the wrong type.

Every command that reads the file refuses it in one line, exit 2, at once: the same file
the daemon would refuse, never half-used, never a hang.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from daemon_helpers import env, gpuwatch_cmd

from gpuwatch.errors import ConfigError
from gpuwatch.settings import _describe, load_settings, load_tables, root_in_force
from gpuwatch.testing import SysRoot

pytestmark = pytest.mark.timeout(120)


def alias_bomb(key: str, levels: int = 9) -> str:
    """``key`` holding nine levels of nine aliases each: 9**10 strings once expanded, a few
    hundred bytes on disk."""
    lines = [f"{key}:", '  - &l0 ["x","x","x","x","x","x","x","x","x"]']
    lines += [f"  - &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("key", ["root", "gpu_vendors", "device_patterns", "log_keep"])
def test_an_alias_bomb_is_refused_before_anything_walks_it(tmp_path: Path, key: str) -> None:
    file = tmp_path / "bomb.yaml"
    file.write_text(alias_bomb(key))
    for load in (lambda: load_tables(str(file)),
                 lambda: load_settings(config=str(file), env={}, resolve_groups=False)):
        with pytest.raises(ConfigError, match="more than 100000 values once its aliases"):
            load()


def test_aliases_of_a_real_size_are_fine(tmp_path: Path) -> None:
    file = tmp_path / "ok.yaml"
    file.write_text("device_patterns: &p ['/dev/kfd', '/dev/kvm']\n"
                    "host_console_drivers: ['ast']\n")
    assert "/dev/kfd" in load_tables(str(file)).device_patterns


@pytest.mark.parametrize("text", ["gpu_vendors: &a [*a]\n", "root: &a {x: *a}\n",
                                  "device_patterns: &a [x, [*a]]\n"])
def test_an_alias_inside_its_own_anchor_is_refused_not_a_crash(host: SysRoot, tmp_path: Path,
                                                               text: str) -> None:
    """An alias inside its own anchor makes a list (or mapping) that holds itself: its
    count was an endless recursion, an internal error (exit 1) instead of a refusal."""
    file = tmp_path / "cycle.yaml"
    file.write_text(text)
    with pytest.raises(ConfigError, match="more than 100000 values once its aliases"):
        load_settings(config=str(file), env={}, resolve_groups=False)
    done = subprocess.run(gpuwatch_cmd("status", "--root", str(host.root), "--config", str(file)),
                          capture_output=True, text=True, env=env(), timeout=60)
    assert (done.returncode, done.stderr) == (
        2, f"gpuwatch: {file}: more than 100000 values once its aliases are expanded\n")


@pytest.mark.parametrize("words", [["status"], ["probe", "detect-vfio"], ["list", "--json"],
                                   ["watch", "--source", "file:/dev/null", "--log", "-"]],
                         ids=" ".join)
def test_the_cli_refuses_a_bomb_in_one_line(host: SysRoot, tmp_path: Path,
                                            words: list[str]) -> None:
    file = tmp_path / "bomb.yaml"
    file.write_text(alias_bomb("root"))
    done = subprocess.run(gpuwatch_cmd(*words, "--root", str(host.root), "--config", str(file)),
                          capture_output=True, text=True, env=env(), timeout=60)
    assert (done.returncode, done.stderr) == (
        2, f"gpuwatch: {file}: more than 100000 values once its aliases are expanded\n")


@pytest.mark.parametrize(("text", "message"), [
    ("root: [1, 2]\n", "root: must be a string, not [1, 2]"),
    ("log_keep: 0\n", "log_keep: must be an integer from 1 to 1000, not 0"),
    ("reconcile_interval: .nan\n",
     "reconcile_interval: must be a number from 0 to 604800, not '.nan'"),
    ("metrics: 'x:99999'\n", "metrics: 'x:99999' is not HOST:PORT"),
    ("verbose: maybe\n", "verbose: must be true or false (1/0, true/false, yes/no, on/off), "
     "not 'maybe'"),
    # Scalars the parser takes but no Python value holds: the file's error, not ours.
    ("log: 2001-02-30\n", "a value YAML cannot read (day is out of range for month)"),
    # A number setting's scalar is its text, read as the flag reads it (digits too many
    # for int() are refused as they are from the flag).
    ("log_keep: " + "9" * 5000 + "\n", "log_keep: must be an integer from 1 to 1000, not '9999"),
    ("root: !!float abc\n", "a value YAML cannot read (could not convert string to float"),
    ("root: !!int 0x\n", "a value YAML cannot read (invalid literal for int()"),
    # Waits a thread or a date cannot hold.
    ("proc_read_timeout: 1.0e+300\n",
     "proc_read_timeout: must be a number from 0.01 to 604800, not 1.0e+300"),
    ("nfd_expiry: 1.0e+12\n", "nfd_expiry: must be 0 (labels never expire) or from 120 to "
     "604800 (NFD reads features.d about once a minute), not 1.0e+12"),
    # A socket option is a C int; each rotation looks at every slot it keeps.
    ("receive_buffer: 3000000000\n",
     "receive_buffer: must be an integer from 4096 to 2147483647, or empty for its default, "
     "not 3000000000"),
    ("log_keep: 1000000000\n", "log_keep: must be an integer from 1 to 1000, not 1000000000"),
    # A group no host has: (gid_t)-1 is chown's "no change"; getgrnam raises on a NUL.
    ("socket_group: 4294967295\n", "socket_group: group 4294967295 is no gid (0-4294967294)"),
    ('switch_group: "adm\\0in"\n', "switch_group: group 'adm\\x00in' is no group name"),
    # A key given twice (YAML keeps the last, silently); a table key that is no id.
    ("root: /a\nlog_keep: 2\nroot: /b\n", "key 'root' given twice"),
    ("gpu_vendors: {0x10de: A, 0x1002: B, 0x10de: C}\n", "key '0x10de' given twice"),
    ("gpu_vendors: {'zz': Acme}\n", "gpu_vendors: Value error, 'zz' is not a hex id"),
    # A device pattern names nodes in /dev, nothing else of the host.
    ("device_patterns: ['/dev/../../etc/pass*']\n",
     "device_patterns: Value error, pattern '/dev/../../etc/pass*' must stay in /dev/"),
])
@pytest.mark.parametrize("words", [["status"], ["probe", "detect-vfio"], ["mode"]],
                         ids=" ".join)
def test_a_command_refuses_a_file_the_daemon_would_refuse(
        host: SysRoot, tmp_path: Path, text: str, message: str, words: list[str]) -> None:
    """Only the tables matter to a probe, but a file whose options are wrong is a wrong
    file: the probe says so (as ``gpuwatch watch`` would) instead of using half of it, or
    scanning ``/`` when its ``root`` is not a path."""
    file = tmp_path / "config.yaml"
    file.write_text(text)
    done = subprocess.run(gpuwatch_cmd(*words, "--config", str(file)),
                          capture_output=True, text=True, env=env(), timeout=60)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.startswith(f"gpuwatch: {file}: {message}")
    assert done.stderr.count("\n") == 1


@pytest.mark.parametrize(("variables", "text", "message"), [
    ({"GPUWATCH_SOCKET_GROUP": "9" * 5000}, "",
     "environment GPUWATCH_SOCKET_GROUP: group " + "9" * 37 + "... is no gid (0-4294967294)"),
    ({}, 'switch_group: "' + "9" * 5000 + '"\n',
     "{file}: switch_group: group " + "9" * 37 + "... is no gid (0-4294967294)"),
    ({}, 'socket_group: "a\\0b"\n',
     "{file}: socket_group: group 'a\\x00b' is no group name (a NUL byte)"),
], ids=["environment-5000-digits", "file-5000-digits", "file-nul-byte"])
def test_the_daemon_refuses_a_group_no_host_has_in_one_line(
        host: SysRoot, tmp_path: Path, variables: dict[str, str], text: str,
        message: str) -> None:
    """A gid of thousands of digits (``int()`` refuses to convert it) or a group name with
    a NUL byte (``getgrnam`` raises on it) was an internal error, exit 1."""
    file = tmp_path / "config.yaml"
    file.write_text(text)
    done = subprocess.run(
        gpuwatch_cmd("watch", "--root", str(host.root), "--config", str(file),
                     "--source", "file:/dev/null", "--log", str(tmp_path / "log.jsonl")),
        capture_output=True, text=True, env={**env(), **variables}, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (
        2, "", f"gpuwatch: {message.format(file=file)}\n")


def test_a_bad_value_is_described_in_bounded_time() -> None:
    """The description of a bad value walks a few levels of it, never the whole: a shared
    list nested ten deep is 9**10 items to a plain repr."""
    value: list[object] = ["x"] * 9
    for _ in range(10):
        value = [value] * 9
    text = _describe(value)
    assert len(text) <= 60 and text.startswith("[[[")
    assert _describe("a" * 50) == repr("a" * 50)  # short ones read as before


def test_a_root_the_file_spells_as_a_number_is_the_root_everywhere(tmp_path: Path) -> None:
    """``root: 5`` is the folder ``5`` to the daemon: a direct command read ``/`` (the host
    running it) instead. Both now say there is no such folder."""
    file = tmp_path / "config.yaml"
    file.write_text("root: 5\n")
    assert root_in_force(None, str(file), env={}) == "5"
    for words in (["probe", "detect-host-devices"], ["status"],
                  ["watch", "--source", "file:/dev/null", "--log", str(tmp_path / "l")]):
        done = subprocess.run(gpuwatch_cmd(*words, "--config", str(file)), capture_output=True,
                              text=True, env=env(), timeout=60, cwd=tmp_path)
        assert (done.returncode, done.stdout, done.stderr) == (
            2, "", f"gpuwatch: {file}: root: '5' is not a directory\n"), words


@pytest.mark.parametrize("words", [["probe", "detect-host-devices"], ["status"], ["list"],
                                   ["holders"], ["plan", "vfio"],
                                   ["watch", "--source", "file:/dev/null", "--log", "-"]],
                         ids=" ".join)
def test_a_root_that_is_no_folder_is_blamed_on_what_named_it(
        tmp_path: Path, words: list[str]) -> None:
    """``GPUWATCH_ROOT=/nonexist gpuwatch status`` said ``--root '/nonexist' is not a
    directory``, a flag nobody gave: the line names the variable (or the file and key), as
    every bad setting's does (docs/service.md)."""
    gone = str(tmp_path / "nonexist")
    done = subprocess.run(gpuwatch_cmd(*words), capture_output=True, text=True,
                          env={**env(), "GPUWATCH_ROOT": gone}, timeout=60, cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (
        2, "", f"gpuwatch: environment GPUWATCH_ROOT: {gone!r} is not a directory\n")
    file = tmp_path / "config.yaml"
    file.write_text(f"root: {gone}\n")
    done = subprocess.run(gpuwatch_cmd(*words), capture_output=True, text=True,
                          env={**env(), "GPUWATCH_CONFIG": str(file)}, timeout=60, cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (
        2, "", f"gpuwatch: {file}: root: {gone!r} is not a directory\n")
    done = subprocess.run(gpuwatch_cmd(*words, "--root", gone), capture_output=True, text=True,
                          env={**env(), "GPUWATCH_CONFIG": str(file)}, timeout=60, cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (
        2, "", f"gpuwatch: --root {gone!r} is not a directory\n")


@pytest.mark.parametrize("words", [["probe", "detect-host-devices"], ["status"], ["list"]],
                         ids=" ".join)
def test_a_blank_root_variable_is_refused_as_the_daemon_refuses_it(
        tmp_path: Path, words: list[str]) -> None:
    """A blank ``$GPUWATCH_ROOT`` read as unset sent a direct command to the host running it,
    while the daemon refuses to start on it."""
    with pytest.raises(ConfigError, match="environment GPUWATCH_ROOT: must not be empty"):
        root_in_force(None, env={"GPUWATCH_ROOT": "  "})
    done = subprocess.run(gpuwatch_cmd(*words), capture_output=True, text=True,
                          env={**env(), "GPUWATCH_ROOT": "  "}, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (
        2, "", "gpuwatch: environment GPUWATCH_ROOT: must not be empty\n")


def test_a_table_key_is_spelled_as_the_model_spells_ids(tmp_path: Path) -> None:
    """``10DE`` (no ``0x``, upper case) could never match the model's ``0x10de``."""
    file = tmp_path / "config.yaml"
    file.write_text("gpu_vendors: {'10DE': Acme, 0x1002: AMD}\n"
                    "pci_class_labels: {'0X0300': VGA}\n")
    tables = load_tables(str(file))
    assert dict(tables.gpu_vendors) == {"0x10de": "Acme", "0x1002": "AMD"}
    assert dict(tables.pci_class_labels) == {"0x0300": "VGA"}
