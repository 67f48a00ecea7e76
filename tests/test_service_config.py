"""Settings of ``gpuwatch watch``: flag > GPUWATCH_* environment > config file > default, and
one clear line naming the key (exit 2) for anything wrong."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.cli.main import main
from gpuwatch.settings import (
    SETTING_KEYS,
    SETTINGS,
    ConfigError,
    WatchSettings,
    load_settings,
    load_tables,
)
from gpuwatch.testing import SysRoot

REPO = Path(__file__).resolve().parent.parent
NOWHERE = "/nonexistent/gpuwatch/config.yaml"


def settings(
    flags: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    file: str | None = None,
    **kw: Any,
) -> WatchSettings:
    return load_settings(flags, env=env or {}, config=file, default_config=NOWHERE, **kw)


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults() -> None:
    s = settings()
    assert (s.root, s.source, s.log, s.log_max_bytes, s.log_keep, s.reconcile_interval) == (
        "/",
        "auto",
        "-",
        None,
        5,
        300.0,
    )
    assert (s.socket, s.switch_group, s.metrics, s.nfd_features, s.nfd_expiry, s.verbose) == (
        None,
        None,
        None,
        None,
        3600.0,
        False,
    )
    assert s.config_path is None and set(s.origins.values()) == {"default"}


def test_every_watch_flag_is_a_setting() -> None:
    from gpuwatch.cli.main import build_parser

    parser = build_parser()
    watch = next(
        a
        for a in parser._subparsers._group_actions  # type: ignore[union-attr]
        if a.dest == "command"
    ).choices["watch"]
    flags = {o for a in watch._actions for o in a.option_strings if o.startswith("--")}
    assert flags - {"--help", "--config"} == {s.flag for s in SETTINGS}


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    file = write(
        tmp_path,
        "log_keep: 3\nreconcile_interval: 60\nmetrics: 127.0.0.1:9000\n"
        "socket: /run/a.sock\nverbose: true\n",
    )
    env = {"GPUWATCH_LOG_KEEP": "4", "GPUWATCH_METRICS": "127.0.0.1:9001", "GPUWATCH_VERBOSE": "0"}
    s = settings({"log_keep": 6}, env, file)
    assert s.log_keep == 6 and s.origins["log_keep"] == "flag"
    assert s.metrics == "127.0.0.1:9001" and s.origins["metrics"] == "env"
    assert s.verbose is False and s.origins["verbose"] == "env"
    assert s.reconcile_interval == 60.0 and s.origins["reconcile_interval"] == "file"
    assert s.socket == "/run/a.sock" and s.origins["socket"] == "file"
    assert s.log_max_bytes is None and s.origins["log_max_bytes"] == "default"
    assert s.config_path == file


def test_empty_environment_value_turns_an_optional_setting_off(tmp_path: Path) -> None:
    file = write(tmp_path, "socket: /run/a.sock\nlog_max_bytes: 1000\n")
    s = settings(env={"GPUWATCH_SOCKET": "", "GPUWATCH_LOG_MAX_BYTES": ""}, file=file)
    assert (s.socket, s.log_max_bytes) == (None, None)


@pytest.mark.parametrize(("key", "given"), [("log_max_bytes", "1000"),
                                             ("receive_buffer", "8192")])
def test_an_empty_flag_or_file_value_turns_an_optional_number_off(
        tmp_path: Path, key: str, given: str) -> None:
    """service.md: an empty value turns an optional setting off in the environment, the
    file and on the command line alike. For the optional numbers an empty flag was an
    argparse error ("'' is not an integer", exit 2) and an empty file value a refused file,
    so the rotation the shipped config sets (``log_max_bytes``) could not be undone by a
    flag: only the environment could."""
    from gpuwatch.cli.main import build_parser
    from gpuwatch.cli.watch_cmd import settings_from_args

    file = write(tmp_path, f"{key}: {given}\n")
    flag = "--" + key.replace("_", "-")
    args = build_parser().parse_args(["watch", "--config", file, flag, ""])
    s = settings_from_args(args)
    assert (getattr(s, key), s.origins[key]) == (None, "flag")
    args = build_parser().parse_args(["watch", "--config", file, flag, given])
    assert getattr(settings_from_args(args), key) == int(given)  # a number still counts
    s = settings(file=write(tmp_path, f'{key}: ""\n', "empty.yaml"))
    assert (getattr(s, key), s.origins[key]) == (None, "file")
    assert getattr(settings(env={"GPUWATCH_" + key.upper(): ""}, file=file), key) is None
    args = build_parser().parse_args(["watch", flag, "x"])
    with pytest.raises(ConfigError, match=f"{flag}: must be an integer"):  # a word is no number
        settings_from_args(args)


@pytest.mark.parametrize(("flags", "env", "text"), [
    ({}, {"GPUWATCH_SOCKET_GROUP": ""}, "socket_group: admins\n"),
    ({}, {}, "socket_group:\n"),
    ({}, {}, "socket_group: ''\n"),
    ({"socket_group": ""}, {}, "socket_group: admins\n"),
])
def test_a_socket_group_set_empty_is_root_only_not_the_default_group(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: dict[str, Any],
        env: dict[str, str], text: str) -> None:
    """On a host with a ``gpuwatch`` group, an empty ``socket_group`` once fell back to it,
    so an operator turning readers off (as an empty value turns every optional setting off)
    still gave the whole group the socket."""
    import gpuwatch.settings as settings_module

    monkeypatch.setattr(settings_module, "default_socket_gid", lambda: 4242)
    assert settings().socket_gid == 4242  # nobody named a group: the default group reads
    s = settings(flags, env=env, file=write(tmp_path, text))
    assert s.socket_gid is None  # root (and the daemon's user) only


def test_which_config_file(tmp_path: Path) -> None:
    default = write(tmp_path, "log_keep: 2\n", "default.yaml")
    from_env = write(tmp_path, "log_keep: 3\n", "env.yaml")
    flag = write(tmp_path, "log_keep: 4\n", "flag.yaml")
    assert load_settings(env={}, default_config=default).log_keep == 2  # present: read
    assert load_settings(env={"GPUWATCH_CONFIG": from_env}, default_config=default).log_keep == 3
    assert (
        load_settings(
            env={"GPUWATCH_CONFIG": from_env}, config=flag, default_config=default
        ).log_keep
        == 4
    )
    assert load_settings(env={}, default_config=str(tmp_path / "absent.yaml")).config_path is None
    with pytest.raises(ConfigError, match="config file not found"):
        load_settings(
            env={"GPUWATCH_CONFIG": str(tmp_path / "absent.yaml")}, default_config=NOWHERE
        )


def test_the_shipped_example_config_loads() -> None:
    s = settings(file=str(REPO / "contrib/config.yaml"))
    assert (s.log_max_bytes, s.log_keep) == (64 << 20, 5)


def test_the_shipped_example_config_has_every_key_and_each_example_loads(
        tmp_path: Path) -> None:
    """docs/service.md: ``contrib/config.yaml`` is "every key, commented"; ``proc_read_timeout``
    and five of the six tables were missing from it. Each commented example, uncommented, is
    a value the daemon takes."""
    from gpuwatch.core.tabledata import TABLE_KEYS

    text = (REPO / "contrib/config.yaml").read_text()
    keys = set(re.findall(r"^#? ?([a-z_]+):", text, re.M))
    assert set(SETTING_KEYS) | set(TABLE_KEYS) <= keys
    uncommented = re.sub(r"^# ?(?=[a-z_]+:|  )", "", text, flags=re.M)
    s = settings(file=write(tmp_path, uncommented), resolve_groups=False)  # no such groups here
    assert (s.proc_read_timeout, s.socket, dict(s.tables().gpu_vendors)["0x1af4"]) == (
        2.0, "/run/gpuwatch/gpuwatch.sock", "Virtio")


def test_tables_and_settings_share_one_file(tmp_path: Path) -> None:
    file = write(tmp_path, "gpu_vendors:\n  0x1af4: Virtio\nlog_keep: 2\nsocket_group: '0'\n")
    assert dict(load_tables(file).gpu_vendors) == {"0x1af4": "Virtio"}  # options accepted here
    s = settings(file=file)
    assert s.log_keep == 2 and dict(s.tables().gpu_vendors) == {"0x1af4": "Virtio"}
    assert s.socket_gid == 0 and set(SETTING_KEYS) >= {"socket", "metrics", "nfd_features"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("log_keep: x\n", "log_keep: must be an integer"),
        ("log_keep: 0\n", "log_keep: must be an integer from 1 to 1000, not 0"),
        ("log_keep: 2.5\n", "log_keep: must be an integer"),
        ("log_keep: true\n", "log_keep: must be an integer"),
        ("log_max_bytes: -5\n", "log_max_bytes: must be an integer from 1 to"),
        ("reconcile_interval: fast\n", "reconcile_interval: must be a number"),
        ("reconcile_interval: -1\n", "reconcile_interval: must be a number from 0 to 604800"),
        # NFD re-reads features.d about once a minute; a shorter expiry wrote files already
        # expired, rewritten without pause.
        ("nfd_expiry: 0.001\n", "nfd_expiry: must be 0 (labels never expire) or from 120"),
        ("nfd_expiry: 119.5\n", "nfd_expiry: must be 0 (labels never expire) or from 120"),
        ("verbose: maybe\n", "verbose: must be true or false"),
        ("source: netlink\n", "source: must be auto, udev, kernel or file:PATH"),
        ("metrics: 'localhost:http'\n", "metrics: 'localhost:http' is not HOST:PORT"),
        ("socket: [a, b]\n", "socket: must be a string"),
        (
            "socket_group: no-such-group-gw\n",
            "socket_group: group 'no-such-group-gw' does not exist",
        ),
        ("log: null\n", "log: must not be empty"),
        ("lg_keep: 3\n", "unknown key 'lg_keep'"),
        ("gpu_vendors: 5\n", "gpu_vendors"),
        ("log_keep: [\n", "not valid YAML"),
        ("- a list\n", "expected a mapping"),
    ],
)
def test_bad_file_values_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    file = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        settings(file=file)
    assert message in str(info.value) and file in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"GPUWATCH_LOG_KEEP": "many"}, "environment GPUWATCH_LOG_KEEP: must be an integer"),
        ({"GPUWATCH_RECONCILE_INTERVAL": "nan"},
         "GPUWATCH_RECONCILE_INTERVAL: must be a number from 0 to 604800, not nan"),
        ({"GPUWATCH_VERBOSE": "2"}, "GPUWATCH_VERBOSE: must be true or false"),
        ({"GPUWATCH_SWITCH_GROUP": "no-such-group-gw"}, "GPUWATCH_SWITCH_GROUP: group"),
        ({"GPUWATCH_SOURCE": ""}, "GPUWATCH_SOURCE: must be auto"),
        # A wait past what a thread's timer or a date holds; a gid past what chown takes.
        ({"GPUWATCH_PROC_READ_TIMEOUT": "1e300"}, "from 0.01 to 604800, not 1e300"),
        ({"GPUWATCH_SOCKET_STALL_TIMEOUT": "1e10"}, "from 0.001 to 604800, not 1e10"),
        ({"GPUWATCH_RECEIVE_BUFFER": "4294967296"},
         "GPUWATCH_RECEIVE_BUFFER: must be an integer from 4096 to 2147483647, or empty for its "
         "default, not 4294967296"),
        ({"GPUWATCH_SOCKET_GROUP": "99999999999999999999"},
         "GPUWATCH_SOCKET_GROUP: group 99999999999999999999 is no gid (0-4294967294)"),
    ],
)
def test_bad_environment_values_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        settings(env=env)


def test_unrelated_environment_is_ignored() -> None:
    assert settings(env={"GPUWATCH_DEBUG": "1", "GPUWATCH_WHATEVER": "x"}).log_keep == 5


def test_watch_with_a_bad_config_exits_2_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    file = write(tmp_path, "log_keep: lots\n")
    assert main(["watch", "--config", file]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "log_keep" in err and "Traceback" not in err
    monkeypatch.setenv("GPUWATCH_METRICS", "nonsense:")
    assert main(["watch", "--root", str(tmp_path)]) == 2
    assert "GPUWATCH_METRICS" in capsys.readouterr().err


def run_watch(
    host: SysRoot, tmp_path: Path, *argv: str, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    events = tmp_path / "uevents.jsonl"
    events.write_text("")  # a file source: the watch ends at its end
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "gpuwatch", "watch", "--source", f"file:{events}", *argv],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=REPO,
        timeout=60,
    )


def test_watch_takes_its_options_from_env_and_file(host: SysRoot, tmp_path: Path) -> None:
    file_log, env_log, flag_log = (
        tmp_path / "file.jsonl",
        tmp_path / "env.jsonl",
        tmp_path / "flag.jsonl",
    )
    config = write(tmp_path, f"root: {host.root}\nlog: {file_log}\nreconcile_interval: 0\n")
    proc = run_watch(host, tmp_path, env={"GPUWATCH_CONFIG": config})
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in file_log.read_text().splitlines()]
    assert [r["type"] for r in records] == ["ready", "stopped"]
    proc = run_watch(host, tmp_path, env={"GPUWATCH_CONFIG": config, "GPUWATCH_LOG": str(env_log)})
    assert proc.returncode == 0 and env_log.exists()
    proc = run_watch(
        host,
        tmp_path,
        "--log",
        str(flag_log),
        env={"GPUWATCH_CONFIG": config, "GPUWATCH_LOG": str(env_log)},
    )
    assert proc.returncode == 0 and flag_log.exists()
    assert len(env_log.read_text().splitlines()) == 2  # the flag won: nothing more went there


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--receive-buffer", "2147483648", "--receive-buffer: must be an integer from 4096 to "
     "2147483647"),
    ("--receive-buffer", "0", "--receive-buffer: must be an integer from 4096 to"),
    ("--log-keep", "100000", "--log-keep: must be an integer from 1 to 1000, not 100000"),
    ("--socket-max-output-bytes", "1", "from 4096 to 67108864, not 1"),
    ("--nfd-expiry", "0.001", "--nfd-expiry: must be 0 (labels never expire) or from 120"),
])
def test_watch_flags_past_their_bounds_exit_2_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str,
        message: str) -> None:
    """A receive buffer past the socket option's C int once reached the kernel as a
    TypeError; every flag gets its setting's bounds, the least one from argparse alike."""
    try:
        code = main(["watch", "--root", str(tmp_path), flag, value])
    except SystemExit as exc:
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert message in err and err.count("\n") == 1, err


def test_nfd_expiry_is_0_or_at_least_120() -> None:
    """0 keeps its meaning (no expiry directive); 120 s is the least NFD can honour."""
    assert settings({"nfd_expiry": 0}).nfd_expiry == 0
    assert settings(env={"GPUWATCH_NFD_EXPIRY": "120"}).nfd_expiry == 120
    with pytest.raises(ConfigError, match=r"GPUWATCH_NFD_EXPIRY: must be 0 .* from 120"):
        settings(env={"GPUWATCH_NFD_EXPIRY": "60"})


def test_library_sources_refuse_a_buffer_no_socket_takes() -> None:
    from gpuwatch.errors import UsageError
    from gpuwatch.sources.kernel import KernelSource
    from gpuwatch.watch.eventlog import EventLog

    for size in (2**31, 4095, -1):
        with pytest.raises(UsageError, match="receive_buffer must be an integer from 4096"):
            KernelSource(receive_buffer=size)
    assert KernelSource(receive_buffer=2**31 - 1).receive_buffer == 2**31 - 1
    with pytest.raises(UsageError, match="keep must be from 0 to 1000"):
        EventLog("-", keep=1001)
