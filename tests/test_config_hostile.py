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
from gpuwatch.settings import _describe, load_settings, load_tables
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
    ("log_keep: 0\n", "log_keep: must be at least 1, not 0"),
    ("reconcile_interval: .nan\n", "reconcile_interval: must be a finite number, not nan"),
    ("metrics: 'x:99999'\n", "metrics: 'x:99999' is not HOST:PORT"),
    ("verbose: maybe\n", "verbose: must be true or false, not 'maybe'"),
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


def test_a_bad_value_is_described_in_bounded_time() -> None:
    """The description of a bad value walks a few levels of it, never the whole: a shared
    list nested ten deep is 9**10 items to a plain repr."""
    value: list[object] = ["x"] * 9
    for _ in range(10):
        value = [value] * 9
    text = _describe(value)
    assert len(text) <= 60 and text.startswith("[[[")
    assert _describe("a" * 50) == repr("a" * 50)  # short ones read as before
