"""Every boolean setting, written in the config file and set in the environment: the same
spellings taken (1/0, true/false, yes/no, on/off, any case, quoted or not), the same
refused in one line that names the key or variable and the spellings, exit 2. YAML 1.1
typed the file's scalar first, so ``verbose: 1`` and ``verbose: "yes"`` were refused
("must be true or false, not 1") where ``GPUWATCH_VERBOSE=1`` was taken."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_settings_bounds import NOWHERE, clear_gpuwatch_env, read_by_env, read_by_file

from gpuwatch.cli.main import main
from gpuwatch.settings import SETTINGS, ConfigError, Setting, load_settings

BOOLEANS = [s for s in SETTINGS if s.kind == "bool"]
WORDS = "must be true or false (1/0, true/false, yes/no, on/off)"

#: (text, the value every place must make of it: True, False, or None for a refusal).
SPELLINGS: list[tuple[str, bool | None]] = [
    ("1", True), ("0", False), ("true", True), ("false", False), ("yes", True),
    ("no", False), ("on", True), ("off", False), ("True", True), ("FALSE", False),
    ("Yes", True), ("NO", False), ("On", True), ("OFF", False), ("tRuE", True),
    ("oFf", False), (" yes ", True),
    ("2", None), ("-1", None), ("y", None), ("n", None), ("maybe", None), ("1.0", None),
    ("0x1", None), ("", None), ("enable", None),
]


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


@pytest.mark.parametrize("s", BOOLEANS, ids=lambda s: s.key)
@pytest.mark.parametrize(("text", "want"), SPELLINGS, ids=[repr(t) for t, _ in SPELLINGS])
def test_the_file_and_the_variable_read_a_boolean_alike(
        s: Setting, text: str, want: bool | None, tmp_path: Path) -> None:
    file = tmp_path / "config.yaml"
    by_env = read_by_env(s, text)
    # Plain (as YAML 1.1 would type it) and quoted (a string to YAML); an empty plain
    # scalar is a null, the file's own case (below).
    writes = [_quoted(text)] + ([text] if text.strip() else [])
    for yaml_text in writes:
        by_file = read_by_file(s, file, yaml_text)
        if want is None:
            assert by_env == f"environment {s.env}: {WORDS}, not {text!r}", by_env
            assert by_file == f"{file}: {s.key}: {WORDS}, not {text!r}", (yaml_text, by_file)
        else:
            assert by_env is want, (text, by_env)
            assert by_file is want, (yaml_text, by_file)


@pytest.mark.parametrize("s", BOOLEANS, ids=lambda s: s.key)
def test_the_file_s_own_shapes_are_refused_with_the_spellings(
        s: Setting, tmp_path: Path) -> None:
    """A null, a list, and a tag: one line naming the key and what it takes; ``!!bool 1``
    is the text ``1`` (PyYAML's own bool table raised KeyError for it)."""
    file = tmp_path / "config.yaml"
    assert read_by_file(s, file, "") == f"{file}: {s.key}: {WORDS}, not null"
    assert read_by_file(s, file, "[1]") == f"{file}: {s.key}: {WORDS}, not [1]"
    assert read_by_file(s, file, "{a: 1}") == f"{file}: {s.key}: {WORDS}, not {{'a': 1}}"
    assert read_by_file(s, file, "!!bool 1") is True
    assert read_by_file(s, file, "!!str off") is False
    assert read_by_file(s, file, "&v on\nroot: /\n") is True


@pytest.mark.parametrize("s", BOOLEANS, ids=lambda s: s.key)
def test_a_library_flag_takes_python_booleans_and_the_same_words(s: Setting) -> None:
    def flag(value: Any) -> Any:
        try:
            return getattr(load_settings({s.key: value}, env={}, default_config=NOWHERE,
                                         resolve_groups=False), s.key)
        except ConfigError as exc:
            return str(exc)

    assert (flag(True), flag(False), flag(1), flag(0), flag("on"), flag("No")) == (
        True, False, True, False, True, False)
    assert flag(2) == f"{s.flag}: {WORDS}, not '2'"
    assert flag(1.0) == f"{s.flag}: {WORDS}, not 1.0"


def test_a_tag_yaml_cannot_construct_anywhere_is_the_file_s_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``!!bool maybe`` (a setting or a key nobody reads) ended in "internal error:
    KeyError", exit 1."""
    config = tmp_path / "config.yaml"
    config.write_text("gpu_vendors: {'0x10de': !!bool maybe}\n")
    code = main(["list", "--root", str(tmp_path), "--config", str(config)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err == f"gpuwatch: {config}: a value YAML cannot read ('maybe')\n", err


@pytest.mark.parametrize("s", BOOLEANS, ids=lambda s: s.key)
def test_the_daemon_refuses_a_bad_boolean_in_one_line_and_exit_2(
        s: Setting, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    clear_gpuwatch_env(monkeypatch)
    config = tmp_path / "config.yaml"
    for yaml_text, env, where in ((f"{s.key}: 2\n", {}, f"{config}: {s.key}"),
                                  ("", {s.env: "2"}, f"environment {s.env}")):
        config.write_text(yaml_text)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        try:
            code = main(["watch", "--root", str(tmp_path), "--config", str(config)])
        except SystemExit as exc:
            code = int(exc.code or 0)
        err = capsys.readouterr().err
        for k in env:
            monkeypatch.delenv(k)
        assert code == 2, err
        assert err == f"gpuwatch: {where}: {WORDS}, not '2'\n", err
