"""Every number ``gpuwatch watch`` takes, given as a flag, an environment variable and a
config file key: the same values taken, the same values refused with the same one line
(naming the option as the user spelled it and its whole range), exit 2; and the settings
table of docs/service.md says the real defaults and ranges."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.cli.main import build_parser, main
from gpuwatch.settings import SETTINGS, ConfigError, Setting, load_settings

REPO = Path(__file__).resolve().parent.parent
NUMBERS = [s for s in SETTINGS if s.kind in ("int", "float")]
NOWHERE = "/nonexistent/gpuwatch/config.yaml"


def _text(s: Setting, bound: float) -> str:
    return str(int(bound)) if s.kind == "int" else f"{bound:g}"


def _spellings(s: Setting) -> list[str]:
    """Values at, inside and past the bounds, and every odd spelling a hand might type."""
    assert s.minimum is not None and s.maximum is not None, s.key  # every number has both
    lo, hi = s.minimum, s.maximum
    step = 1 if s.kind == "int" else 0.5
    inside = _text(s, hi if s.key == "nfd_expiry" else lo)
    return [
        _text(s, lo - step), _text(s, lo), _text(s, hi), _text(s, hi + step),
        "nan", "inf", "-inf", "", "  ", "x", "9" * 30, "9" * 5000, "-0", "+0",
        f"  {inside}  ", "0x10", "1_000", "1e3", "1.5", "١٢", "1 000",
    ]


def read_by_flag(s: Setting, text: str) -> Any:
    """What the parsed command line makes of ``--FLAG text``: the value, or the message."""
    # FLAG=VALUE: argparse takes "-inf" after a space for an option of its own.
    args = build_parser().parse_args(["watch", f"{s.flag}={text}"])
    flags = {k.key: getattr(args, k.key, None) for k in SETTINGS}  # as settings_from_args
    try:
        return getattr(load_settings(flags, env={}, default_config=NOWHERE,
                                     resolve_groups=False), s.key)
    except ConfigError as exc:
        return str(exc)


def read_by_file(s: Setting, file: Path, yaml_text: str) -> Any:
    """What the config file ``file`` holding ``KEY: yaml_text`` makes of it: the value, or
    the message."""
    file.write_text(f"{s.key}: {yaml_text}\n")
    try:
        return getattr(load_settings(config=str(file), env={}, resolve_groups=False), s.key)
    except ConfigError as exc:
        return str(exc)


def clear_gpuwatch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``GPUWATCH_*`` variable of the test's own environment: a command's settings come
    from what the test gives it alone."""
    for k in [k for k in os.environ if k.startswith("GPUWATCH_")]:
        monkeypatch.delenv(k)


def read_by_env(s: Setting, text: str) -> Any:
    try:
        return getattr(load_settings(env={s.env: text}, default_config=NOWHERE,
                                     resolve_groups=False), s.key)
    except ConfigError as exc:
        return str(exc)


@pytest.mark.parametrize("s", NUMBERS, ids=lambda s: s.key)
def test_a_flag_and_its_variable_take_and_refuse_the_same_values(s: Setting) -> None:
    """``--socket-stall-timeout -1`` said "must be non-negative" (argparse's type), and 0
    then "must be at least 0.001" (the settings'); ``--socket-root-reserve nan`` got
    argparse's "invalid int value" while -1 got the settings' line. A flag now reads its
    words as the variable does: one reader, one message, whatever the value."""
    for text in _spellings(s):
        by_flag, by_env = read_by_flag(s, text), read_by_env(s, text)
        if isinstance(by_flag, str):
            assert by_flag.startswith(f"{s.flag}: "), (text, by_flag)
            assert isinstance(by_env, str), (text, by_env)
            assert by_env.startswith(f"environment {s.env}: "), (text, by_env)
            assert by_flag.split(": ", 1)[1] == by_env.split(": ", 1)[1], text
            _assert_says_the_range(s, by_flag)
        elif by_flag is None:  # empty: an optional setting's default
            assert by_env is None and s.optional and not text.strip(), text
        else:
            assert by_flag == by_env, text
            assert s.minimum is not None and s.maximum is not None
            assert s.minimum <= by_flag <= s.maximum
            assert type(by_flag) is (int if s.kind == "int" else float)
            assert str(by_flag) != "-0.0"


def _assert_says_the_range(s: Setting, message: str) -> None:
    assert "\n" not in message and len(message) < 240, message
    assert s.minimum is not None and s.maximum is not None
    assert f"from {_text(s, s.minimum if s.key != 'nfd_expiry' else 120)} to " \
           f"{_text(s, s.maximum)}" in message, message


@pytest.mark.parametrize("s", NUMBERS, ids=lambda s: s.key)
def test_the_file_takes_and_refuses_the_numbers_a_variable_does(
        s: Setting, tmp_path: Path) -> None:
    """The same numbers written in YAML (``.nan`` is YAML's nan) get the same answer, and
    the refusals the same words after ``FILE: key:``."""
    assert s.minimum is not None and s.maximum is not None
    step = 1 if s.kind == "int" else 0.5
    cases = {_text(s, s.minimum - step): _text(s, s.minimum - step),
             _text(s, s.minimum): _text(s, s.minimum),
             _text(s, s.maximum): _text(s, s.maximum),
             _text(s, s.maximum + step): _text(s, s.maximum + step),
             ".nan": "nan", ".inf": "inf", "-.inf": "-inf", "-0": "-0", "1_000": "1_000"}
    file = tmp_path / "config.yaml"
    for yaml_text, env_text in cases.items():
        by_file = read_by_file(s, file, yaml_text)
        by_env = read_by_env(s, env_text)
        if isinstance(by_file, str):
            assert by_file.startswith(f"{file}: {s.key}: "), by_file
            assert isinstance(by_env, str), (yaml_text, by_env)
            # The same words up to the value, shown as each place spelled it (YAML's .nan
            # is the float nan, the variable's nan a word).
            said_file, said_env = by_file.split(": ", 2)[2], by_env.split(": ", 1)[1]
            assert said_file.rsplit(", not ", 1)[0] == said_env.rsplit(", not ", 1)[0]
        else:
            assert by_file == by_env, yaml_text


@pytest.mark.parametrize("s", NUMBERS, ids=lambda s: s.key)
def test_the_command_refuses_a_bad_number_in_one_line_and_exit_2(
        s: Setting, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    clear_gpuwatch_env(monkeypatch)
    config = tmp_path / "config.yaml"
    config.write_text("")
    for argv, env in (([f"{s.flag}=nan"], {}), ([], {s.env: "-1e400"})):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        try:
            code = main(["watch", "--root", str(tmp_path), "--config", str(config), *argv])
        except SystemExit as exc:
            code = int(exc.code or 0)
        err = capsys.readouterr().err
        for k in env:
            monkeypatch.delenv(k)
        assert code == 2, err
        assert err.count("\n") == 1 and "Traceback" not in err and "usage" not in err, err
        where = s.flag if argv else f"environment {s.env}"
        assert err.startswith(f"gpuwatch: {where}: must be "), err
        _assert_says_the_range(s, err.strip())


def _doc_rows() -> dict[str, list[str]]:
    doc = (REPO / "docs" / "service.md").read_text()
    table = doc.split("\n## Settings", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`(\w+)`", cells[0]) if line.startswith("|") else None
        if match:
            rows[match.group(1)] = cells
    return rows


def test_the_settings_table_says_the_real_defaults_names_and_ranges() -> None:
    """Each row's flag, variable and default are the code's, and each number's row says
    its range: a bound changed in the code and not in the docs fails here."""
    from gpuwatch.settings import DEFAULT_SOCKET_GROUP
    from gpuwatch.sources.kernel import DEFAULT_RECEIVE_BUFFER

    rows = _doc_rows()
    assert set(rows) == {s.key for s in SETTINGS}
    for s in SETTINGS:
        _, flag, env, default, what = rows[s.key]
        assert s.flag in re.findall(r"--[\w-]+", flag), (s.key, flag)
        assert env == f"`{s.env}`", s.key
        if s.key == "receive_buffer":
            assert default == f"{DEFAULT_RECEIVE_BUFFER >> 20} MiB"
        elif s.key == "socket_group":
            assert default.startswith(f"`{DEFAULT_SOCKET_GROUP}` if it exists")
        elif s.default is None:
            assert default.startswith("none"), (s.key, default)
        elif isinstance(s.default, bool):
            assert default == f"`{str(s.default).lower()}`", s.key
        elif isinstance(s.default, float):
            assert default == f"`{s.default:g}`", (s.key, default)
        else:
            assert default == f"`{s.default}`", (s.key, default)
        if s.kind in ("int", "float"):
            assert s.minimum is not None and s.maximum is not None
            lo = 120 if s.key == "nfd_expiry" else s.minimum
            assert f"{_text(s, lo)} to {_text(s, s.maximum)}" in what, (s.key, what)


#: What a hand writes in the file (YAML) and the same words given as the flag: YAML 1.1
#: reads ``0x10`` as 16, ``010`` as octal 8, ``1:30`` as sexagesimal 90, ``0b101`` as 5,
#: ``5.0`` as a float an integer setting then took, and refuses the quoted ``"5"``.
YAML_SPELLINGS = {
    "0x10": "0x10", "010": "010", "0o10": "0o10", "1:30": "1:30", "0b101": "0b101",
    "5.0": "5.0", "5.": "5.", ".5": ".5", "1e3": "1e3", "1_000": "1_000", "+5": "+5",
    "'5'": "5", '"5"': "5", '" 7 "': " 7 ", "5": "5", "0": "0", "-0": "-0",
    "yes": "yes", "2001-02-03": "2001-02-03", ".inf": ".inf", "9" * 5000: "9" * 5000,
}


@pytest.mark.parametrize("s", NUMBERS, ids=lambda s: s.key)
def test_the_file_reads_a_number_as_the_flag_reads_its_words(s: Setting,
                                                              tmp_path: Path) -> None:
    """``log_keep: 0x10`` kept 16 rotated files where ``--log-keep 0x10`` is refused, ``010``
    kept 8 where the flag keeps 10, ``1:30`` 90, and ``"5"`` was refused where the flag takes
    it: the file's number is now its text, read by the flag's rule, with the flag's words
    for a refusal."""
    file = tmp_path / "config.yaml"
    for yaml_text, words in YAML_SPELLINGS.items():
        by_file = read_by_file(s, file, yaml_text)
        by_flag = read_by_flag(s, words)
        if isinstance(by_flag, str):
            assert isinstance(by_file, str), (yaml_text, by_file, by_flag)
            assert by_file.startswith(f"{file}: {s.key}: "), by_file
            assert by_file.split(": ", 2)[2] == by_flag.split(": ", 1)[1], yaml_text
        else:
            assert by_file == by_flag and type(by_file) is type(by_flag), (yaml_text, by_file)


def _from_file(tmp_path: Path, text: str) -> Any:
    file = tmp_path / "config.yaml"
    file.write_text(text)
    try:
        return load_settings(config=str(file), env={}, resolve_groups=False)
    except ConfigError as exc:
        return str(exc).split(": ", 1)[1]


def test_the_text_rule_holds_through_merges_aliases_and_tags(tmp_path: Path) -> None:
    """A number reached through a ``<<`` merge or an alias, or given an explicit tag, is read
    from its text too: YAML 1.1 typed it before the settings saw it."""
    refused = "log_keep: must be an integer from 1 to 1000, not '0x10'"
    assert _from_file(tmp_path, "<<: {log_keep: 0x10}\n") == refused
    assert _from_file(tmp_path, "gpu_vendors: {'0x10de': &n 0x10}\nlog_keep: *n\n") == refused
    assert _from_file(tmp_path, "log_keep: !!int 0x10\n") == refused
    both = _from_file(tmp_path, "log_keep: &k 010\nlog_max_bytes: *k\n")
    assert (both.log_keep, both.log_max_bytes) == (10, 10)
    assert _from_file(tmp_path, "log_keep: !!float 5\n").log_keep == 5
    # A null is still "off" for an optional number, and a missing value for the others.
    assert _from_file(tmp_path, "log_max_bytes: ~\n").log_max_bytes is None
    assert _from_file(tmp_path, "log_keep:\n") == "log_keep: must not be empty (null)"


def test_a_string_setting_keeps_the_digits_written(tmp_path: Path) -> None:
    """``socket_group: 0100`` named gid 64 (YAML 1.1 octal) and ``root: 0x10`` the folder
    ``16``: the same words as a flag or variable now name gid 100 and the folder ``0x10``."""
    got = _from_file(tmp_path, "socket_group: 0100\nswitch_group: 1_000\nroot: 0x10\n")
    assert (got.socket_group, got.switch_group, got.root) == ("0100", "1_000", "0x10")
    assert _from_file(tmp_path, "root: 5\n").root == "5"


def test_the_tables_keep_their_own_reading(tmp_path: Path) -> None:
    """Only the settings are read as text: a table's unquoted hex key is still YAML's int
    (the tables' documented rule), here 0x10de."""
    got = _from_file(tmp_path, "gpu_vendors: {0x10de: Team Green}\nlog_keep: 3\n")
    assert got.log_keep == 3 and got.tables().gpu_vendors["0x10de"] == "Team Green"


@pytest.mark.parametrize("s", [s for s in NUMBERS if s.kind == "float"], ids=lambda s: s.key)
def test_an_int_past_a_double_s_range_is_a_range_refusal_from_the_api(s: Setting) -> None:
    """A library caller's ``flags={KEY: 10**400}`` ended in Python's OverflowError ("int too
    large to convert to float"), not in the setting's one line."""
    with pytest.raises(ConfigError, match=f"^{re.escape(s.flag)}: must be .*, not 1000"):
        load_settings({s.key: 10**400}, env={}, default_config=NOWHERE, resolve_groups=False)
