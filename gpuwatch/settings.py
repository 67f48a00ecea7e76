"""Settings, the one module that owns them: every option from flag, environment, file or
default, and the data tables (embedded, or overridden from the same file).

Precedence, highest first: a command-line flag, an environment variable ``GPUWATCH_<KEY>``
(``GPUWATCH_LOG_KEEP=3``), the config file (``--config FILE``, else ``$GPUWATCH_CONFIG``,
else ``/etc/gpuwatch/config.yaml`` when it exists), the default. The config file holds the
options and the data tables (`Tables`); a key that is neither is reported instead of
silently ignored.

Tables are data, not code, so operators can teach gpuwatch a new vendor or device node
without a release. Every bad value is a `ConfigError` whose one-line message names the key
and where it came from; the CLI turns it into exit 2. PyYAML and pydantic are imported on
first use only: ``import gpuwatch`` and ``gpuwatch --help`` stay lean.
"""

from __future__ import annotations

import math
import os
import re
import reprlib
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from gpuwatch.core.limits import (
    MAX_FILE_BYTES,
    MAX_LOG_KEEP,
    MAX_OUTPUT_BYTES,
    MAX_RECEIVE_BUFFER,
    MAX_REQUEST_BYTES,
    MAX_SECONDS,
    MAX_SOCKET_CLIENTS,
    MIN_RECEIVE_BUFFER,
)
from gpuwatch.core.tabledata import TABLE_KEYS
from gpuwatch.errors import BAD_CONFIG, CallerError, ConfigError
from gpuwatch.ownership import others_choose, others_may_write

if TYPE_CHECKING:
    from gpuwatch.core.tables import Tables

DEFAULT_CONFIG_PATH = "/etc/gpuwatch/config.yaml"
ENV_PREFIX = "GPUWATCH_"
#: The environment variable naming the config file (below ``--config``, above the default).
CONFIG_ENV = "GPUWATCH_CONFIG"
#: The root the daemon watches when no ``--root`` is given (also the config file's ``root``).
ROOT_ENV = "GPUWATCH_ROOT"

_HOSTNAME_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")

Kind = Literal["str", "int", "float", "bool"]
Origin = Literal["flag", "env", "file", "default"]


@dataclass(frozen=True, slots=True)
class Setting:
    """One option: its key (file), flag and environment variable are all derived from it."""

    key: str
    kind: Kind
    default: Any
    optional: bool = False  # None ("off") allowed: null in the file, "" in the environment
    minimum: float | None = None  # every "int" and "float" setting has both bounds
    maximum: float | None = None
    #: Returns why a value is bad (a number failing it is refused with `range_words`).
    check: Callable[[Any], str | None] | None = None
    #: A number's range in words, where its bounds alone would say it wrong.
    range_words: str | None = None

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper()

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


def _check_source(value: Any) -> str | None:
    text = str(value).strip()
    if text in ("auto", "udev", "kernel"):
        return None
    if text.startswith("file:") and len(text) > len("file:"):
        return None
    return f"must be auto, udev, kernel or file:PATH, not {value!r}"


class InvalidListenAddress(CallerError, ValueError):
    """``--metrics`` is not ``HOST:PORT``, ``:PORT`` or ``PORT``."""


def parse_listen_address(text: str) -> tuple[str, int]:
    """``127.0.0.1:9464``, ``[::1]:9464``, ``:9464`` or ``9464`` (the last two: all addresses,
    as in Go's and node_exporter's convention) as ``(host, port)``."""
    spec = text.strip()
    host, sep, port_text = spec.rpartition(":")
    if not sep:
        host, port_text = "", spec
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise InvalidListenAddress(f"{text!r} is not HOST:PORT, :PORT or PORT (port 0-65535)")
    if host:
        try:
            import ipaddress  # here: a direct probe never parses an address

            ipaddress.ip_address(host)
        except ValueError:
            if not _HOSTNAME_RE.fullmatch(host):
                raise InvalidListenAddress(
                    f"{text!r}: {host!r} is not a host name or address") from None
    return host or "0.0.0.0", int(port_text)


def _check_metrics(value: Any) -> str | None:
    try:
        parse_listen_address(str(value))
    except InvalidListenAddress as exc:
        return str(exc)
    return None


def _check_nonempty(value: Any) -> str | None:
    return None if str(value).strip() else "must not be empty"


#: The least non-zero ``nfd_expiry`` (also gpuwatch.service.nfd.MIN_EXPIRY).
MIN_NFD_EXPIRY = 120.0


def _check_nfd_expiry(value: Any) -> str | None:
    """0 (no expiry) or long enough for NFD, which re-reads ``features.d`` about once a
    minute: a shorter expiry could lapse between two of its reads of a file kept current,
    and would have the writer rewrite (and fsync) the file over and over."""
    if value == 0 or MIN_NFD_EXPIRY <= value <= MAX_SECONDS:
        return None
    return f"must be {_NFD_RANGE}, not {value:g}"


_NFD_RANGE = (f"0 (labels never expire) or from {MIN_NFD_EXPIRY:g} to {MAX_SECONDS:g} (NFD "
              "reads features.d about once a minute)")


def _group_problem(text: str) -> str | None:
    """Why ``text`` names no group on any host, or None. A number is compared as digits
    first: one of thousands of digits is no gid, and ``int()`` refuses to convert it
    (ValueError); a NUL byte is in no group's name, and ``getgrnam`` raises on one."""
    if text.isascii() and text.isdigit():
        digits = text.lstrip("0") or "0"
        if len(digits) > len(str(_MAX_GID)) or int(digits) > _MAX_GID:
            shown = digits if len(digits) <= 40 else digits[:37] + "..."
            return f"group {shown} is no gid (0-{_MAX_GID})"
    elif "\0" in text:
        return f"group {_describe(text)} is no group name (a NUL byte)"
    return None


def _check_group(value: Any) -> str | None:
    """A group setting's check, made by every command that reads the file (not only the
    daemon, which also looks the name up): a value no host could resolve is refused alike."""
    return _group_problem(str(value).strip())


SETTINGS: tuple[Setting, ...] = (
    Setting("root", "str", "/", check=_check_nonempty),
    Setting("source", "str", "auto", check=_check_source),
    Setting("log", "str", "-", check=_check_nonempty),
    Setting("log_max_bytes", "int", None, optional=True, minimum=1, maximum=MAX_FILE_BYTES),
    Setting("log_keep", "int", 5, minimum=1, maximum=MAX_LOG_KEEP),
    Setting("reconcile_interval", "float", 300.0, minimum=0, maximum=MAX_SECONDS),
    Setting("receive_buffer", "int", None, optional=True, minimum=MIN_RECEIVE_BUFFER,
            maximum=MAX_RECEIVE_BUFFER),
    Setting("socket", "str", None, optional=True),
    Setting("socket_group", "str", None, optional=True, check=_check_group),
    Setting("switch_group", "str", None, optional=True, check=_check_group),
    Setting("socket_max_request_bytes", "int", 65536, minimum=1024, maximum=MAX_REQUEST_BYTES),
    Setting("socket_max_clients", "int", 1024, minimum=1, maximum=MAX_SOCKET_CLIENTS),
    Setting("socket_max_per_uid", "int", 16, minimum=1, maximum=MAX_SOCKET_CLIENTS),
    Setting("socket_root_reserve", "int", 64, minimum=0, maximum=MAX_SOCKET_CLIENTS),
    Setting("socket_stall_timeout", "float", 30.0, minimum=0.001, maximum=MAX_SECONDS),
    Setting("socket_max_output_bytes", "int", 4 << 20, minimum=4096, maximum=MAX_OUTPUT_BYTES),
    Setting("metrics", "str", None, optional=True, check=_check_metrics),
    Setting("nfd_features", "str", None, optional=True),
    Setting("nfd_expiry", "float", 3600.0, minimum=0, maximum=MAX_SECONDS,
            check=_check_nfd_expiry, range_words=_NFD_RANGE),
    Setting("verbose", "bool", False),
    # The whole budget of one /proc scan (holders, plan, switch, wedge-detected): a process
    # stuck in the kernel can block a read of its fd, maps or stack for ever.
    Setting("proc_read_timeout", "float", 2.0, minimum=0.01, maximum=MAX_SECONDS),
    # A switch run from a container (the Kubernetes switching overlay): every host command
    # (systemctl, modprobe, nvidia-modprobe, nvidia-ctk) runs in the host's namespaces
    # through nsenter, so it is the host's own tool reading the host's own configuration.
    Setting("host_namespaces", "bool", False),
)
BY_KEY: Mapping[str, Setting] = {s.key: s for s in SETTINGS}

#: The non-table keys a config file may hold.
SETTING_KEYS: tuple[str, ...] = tuple(s.key for s in SETTINGS)

#: A boolean's spellings, any case, from a flag, the environment and the file alike (the
#: file's YAML 1.1 ``yes``/``On``/``TRUE`` are among them; ``y``/``n`` are nowhere).
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_BOOL_WORDS = "must be true or false (1/0, true/false, yes/no, on/off)"


class _Bad(Exception):
    pass


def _short_repr() -> reprlib.Repr:
    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother, short.maxlong = 3, 58, 58, 58
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = 6
    return short


#: A bounded repr: a YAML alias bomb (``&a [*b, *b, …]``, nine levels) is a few objects
#: shared a billion times over, which a plain repr would walk in full.
_SHORT = _short_repr()


def _describe(value: Any) -> str:
    text = _SHORT.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _from_text(s: Setting, text: str) -> Any:
    """A string (the environment's, or a flag's: both are read here, alike) as the
    setting's type. Numbers are ASCII decimal, as ``int`` reads them (``1_000`` too), not
    any digits Unicode has (``int`` takes ``'١٢'``)."""
    raw = text.strip()
    if s.optional and raw == "":
        return None
    if s.kind == "str":
        return text
    if s.kind == "bool":
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise _Bad(f"{_BOOL_WORDS}, not {_describe(text)}")
    try:
        if not raw.isascii():
            raise ValueError(raw)
        number: float = int(raw, 10) if s.kind == "int" else float(raw)
    except ValueError:  # also an integer of more digits than Python converts
        raise _Bad(_range(s, _describe(text))) from None
    return _in_range(s, number, raw if len(raw) <= 40 else raw[:37] + "...")


def _typed(s: Setting, value: Any) -> Any:
    """A value from the file (YAML types) or a flag, checked against the setting's type."""
    if value is None:
        if s.optional:
            return None
        raise _Bad(f"{_BOOL_WORDS}, not null" if s.kind == "bool" else "must not be empty (null)")
    if s.optional and isinstance(value, str) and not value.strip():
        # Empty turns an optional setting off whatever its type, in the file (``""``) and
        # on the command line (``--log-max-bytes ''``) as in the environment.
        return None
    if s.kind == "str":
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise _Bad(f"must be a string, not {_describe(value)}")
        text = str(value)
        return None if s.optional and not text.strip() else text
    if s.kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, int):  # the library's flags: 1 and 0, as their text reads
            return _from_text(s, str(value))
        raise _Bad(f"{_BOOL_WORDS}, not {_describe(value)}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Bad(_range(s, _describe(value)))
    if s.kind == "int" and isinstance(value, float) and not value.is_integer():
        raise _Bad(_range(s, _describe(value)))  # 2.5, nan and inf alike
    try:
        number = int(value) if s.kind == "int" else float(value)
    except OverflowError:  # an int past a double's range, for a float setting (the API)
        raise _Bad(_range(s, _describe(value))) from None
    return _in_range(s, number, _describe(value))


def _range(s: Setting, shown: str) -> str:
    """Why a number is refused, the same words for every bad value and from every place:
    what it must be, its whole range (and that empty turns it off), and what was given."""
    off = ", or empty for its default" if s.optional else ""
    if s.range_words is not None:
        return f"must be {s.range_words}{off}, not {shown}"
    what = "an integer" if s.kind == "int" else "a number"
    bounds = ""
    if s.minimum is not None and s.maximum is not None:
        bounds = f" from {_bound(s, s.minimum)} to {_bound(s, s.maximum)}"
    return f"must be {what}{bounds}{off}, not {shown}"


def _in_range(s: Setting, number: float, shown: str) -> float:
    """``number`` within the setting's own check and bounds (a value given in seconds as
    ``-0`` is 0), else `_Bad` showing it as it was given (``0``, not ``0.0``)."""
    if isinstance(number, float) and not math.isfinite(number):  # an int of 400 digits
        raise _Bad(_range(s, shown))  # is finite, and too large to be made a float
    if s.check is not None and s.check(number) is not None:
        raise _Bad(_range(s, shown))
    if ((s.minimum is not None and number < s.minimum)
            or (s.maximum is not None and number > s.maximum)):
        raise _Bad(_range(s, shown))
    return number + 0 if s.kind == "float" else number  # -0.0 + 0 is 0.0


def _bound(s: Setting, bound: float) -> str:
    """A bound as the setting's values are written: 2147483647, not 2.14748e+09."""
    return str(int(bound)) if s.kind == "int" else f"{bound:g}"


def _from_file(s: Setting, value: Any) -> Any:
    """A config file's value as the setting's type: a number or a boolean given as text
    (every number and boolean setting's scalar is, `_settings_as_text`) is read by the
    flag's and the environment's rule, so the three places take and refuse the same words."""
    if isinstance(value, str) and s.kind in ("int", "float", "bool"):
        return _from_text(s, value)
    return _typed(s, value)


def _validate(s: Setting, value: Any) -> Any:
    """A typed value's own check (a number's was made with its bounds, in `_in_range`)."""
    if value is None or s.kind in ("int", "float"):
        return value
    if s.check is not None:
        why = s.check(value)
        if why is not None:
            raise _Bad(why)
    return value


@dataclass(frozen=True)
class WatchSettings:
    """The resolved options of one ``gpuwatch watch`` run, with where each came from."""

    root: str = "/"
    source: str = "auto"
    log: str = "-"
    log_max_bytes: int | None = None
    log_keep: int = 5
    reconcile_interval: float = 300.0
    receive_buffer: int | None = None
    socket: str | None = None
    socket_group: str | None = None
    switch_group: str | None = None
    socket_max_request_bytes: int = 65536
    socket_max_clients: int = 1024
    socket_max_per_uid: int = 16
    socket_root_reserve: int = 64
    socket_stall_timeout: float = 30.0
    socket_max_output_bytes: int = 4 << 20
    metrics: str | None = None
    nfd_features: str | None = None
    nfd_expiry: float = 3600.0
    verbose: bool = False
    proc_read_timeout: float = 2.0
    host_namespaces: bool = False
    #: The config file in force (tables and options), or None.
    config_path: str | None = None
    #: `file_identity` of that file as it was read (from the descriptor read), or None.
    config_identity: FileIdentity | None = None
    origins: Mapping[str, Origin] = field(default_factory=dict)
    #: gids resolved from the group settings (None: root only / no switch group).
    socket_gid: int | None = None
    switch_gid: int | None = None

    #: The tables built from the same read of the config file (None: not loaded here).
    loaded_tables: Tables | None = field(default=None, compare=False, repr=False)

    def tables(self) -> Tables:
        """The tables in force, from the one read of the config file `load_settings` did."""
        if self.loaded_tables is not None:
            return self.loaded_tables
        return load_tables(self.config_path)


#: ``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)`` of a file: the same five numbers
#: a second look finds only when it is the same file, unchanged (a rename over it is another
#: inode, a write moves the size or the times).
FileIdentity = tuple[int, int, int, int, int]


def file_identity(st: os.stat_result) -> FileIdentity:
    """A file's `FileIdentity` (also spelt out in `gpuwatch.cli.fast`, which must stay stdlib
    only: a test holds the two to the same order)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def where_set(key: str, origin: Origin | None, config_path: str | None) -> str:
    """Where a setting's value came from, as an error names it: its flag, its environment
    variable or the file and key."""
    s = BY_KEY[key]
    return {"flag": s.flag, "env": f"environment {s.env}",
            "file": f"{config_path}: {key}"}.get(origin or "", key)


def config_file_path(flag: str | os.PathLike[str] | None, env: Mapping[str, str] | None = None,
                     default: str = DEFAULT_CONFIG_PATH) -> str | None:
    """``--config``, else ``$GPUWATCH_CONFIG``, else the default file when it exists."""
    env = os.environ if env is None else env
    if flag:
        return os.fspath(flag)
    if env.get(CONFIG_ENV):
        return env[CONFIG_ENV]
    return default if os.path.isfile(default) else None


@dataclass(frozen=True)
class ConfigInForce:
    """The config file in force, read and checked whole once: its path (None: no file, the
    embedded tables), its raw mapping, the tables built from it and the `file_identity` of
    what was read. A command takes its root, its tables and its settings from this one read,
    so it never checks one file and uses another written over it since (and pays for one
    YAML parse, not one per question)."""

    path: str | None
    raw: Mapping[str, Any]
    #: The tables built from the file (None: no file, the embedded ones, built on first use:
    #: a command that needs only the root, such as ``record``, never imports pydantic).
    loaded_tables: Tables | None = None
    identity: FileIdentity | None = None

    @property
    def tables(self) -> Tables:
        """The tables in force: the file's, else the embedded ones."""
        return self.loaded_tables if self.loaded_tables is not None else default_tables()


def config_in_force(config: str | os.PathLike[str] | None = None,
                    env: Mapping[str, str] | None = None,
                    default: str = DEFAULT_CONFIG_PATH) -> ConfigInForce:
    """The config file `config_file_path` finds, read once and checked whole as the daemon
    checks it (`load_settings`): a file the daemon would refuse is refused by every command
    that reads it (`ConfigError`, exit 2), even one the daemon answers."""
    path = config_file_path(config, env, default)
    if path is None:
        return ConfigInForce(None, {})
    raw, identity = read_config_file_as_read(path)
    tables = build_tables(_only_table_keys(raw, path), path)  # rejects unknown keys too
    return ConfigInForce(path, raw, tables, identity)


def read_once(config: str | os.PathLike[str] | Tables | ConfigInForce | None = None,
              env: Mapping[str, str] | None = None) -> ConfigInForce | Tables:
    """A ``config`` argument to be asked several things (tables, root, settings): a path
    (None: the file in force) read now, once (`config_in_force`); tables or a
    `ConfigInForce` given are as they are."""
    if config is None or isinstance(config, str | os.PathLike):
        return config_in_force(config, env)
    return config


def tables_in_force(config: str | os.PathLike[str] | Tables | ConfigInForce | None = None,
                    env: Mapping[str, str] | None = None) -> Tables:
    """The tables the daemon would use: ``config`` when given, else the file
    `config_file_path` finds, else the embedded ones. The library and every CLI command
    read through here, so a direct probe and the daemon never disagree."""
    if isinstance(config, ConfigInForce):
        return config.tables
    if config is not None and not isinstance(config, str | os.PathLike):
        return config
    return load_tables(config_file_path(config, env))


def root_in_force(root: str | os.PathLike[str] | None = None,
                  config: str | os.PathLike[str] | Tables | ConfigInForce | None = None,
                  env: Mapping[str, str] | None = None) -> str:
    """The host root the daemon would watch: ``root`` when given, else ``$GPUWATCH_ROOT``,
    else the config file's ``root``, else ``/`` (the daemon's own precedence)."""
    return root_and_where(root, config, env)[0]


def root_and_where(root: str | os.PathLike[str] | None = None,
                   config: str | os.PathLike[str] | Tables | ConfigInForce | None = None,
                   env: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """`root_in_force` and where it came from (``environment GPUWATCH_ROOT``, ``FILE: root``;
    None for ``root`` given or the default ``/``): a root that is no folder is blamed on the
    setting that named it, not on a ``--root`` nobody gave."""
    if root is not None:
        return os.fspath(root), None
    env = os.environ if env is None else env
    s = BY_KEY["root"]
    # Each read as the daemon reads it (`load_settings`), so that neither a blank variable
    # nor ``root: 5`` in the file sends a direct command to ``/`` while the daemon refuses
    # the one and watches ``5`` for the other.
    if ROOT_ENV in env:
        try:
            return str(_validate(s, _from_text(s, env[ROOT_ENV]))), f"environment {ROOT_ENV}"
        except _Bad as exc:
            raise ConfigError(f"environment {ROOT_ENV}: {exc}") from None
    if isinstance(config, ConfigInForce):
        path, raw = config.path, config.raw  # the one read of the file
    elif config is not None and not isinstance(config, str | os.PathLike):
        return "/", None  # tables given as such name no file
    else:
        path = config_file_path(config, env)
        raw = read_config_file(path) if path is not None else {}
    if path is not None and "root" in raw:
        try:
            return str(_validate(s, _from_file(s, raw["root"]))), f"{path}: root"
        except _Bad as exc:
            raise ConfigError(f"{path}: root: {exc}") from None
    return "/", None


def _in_force(key: str, config: str | os.PathLike[str] | Tables | ConfigInForce | None,
              env: Mapping[str, str] | None) -> tuple[Any, str | None]:
    """A setting as the daemon resolves it, without flags (``$GPUWATCH_<KEY>``, else the
    config file's key, else the default), and where it was set (None: the default). A bad
    value is a `ConfigError` naming where it came from. For what direct commands and the
    library share with the daemon."""
    env = os.environ if env is None else env
    s = BY_KEY[key]
    where: str | None = None
    try:
        if s.env in env:
            where = f"environment {s.env}"
            return _validate(s, _from_text(s, env[s.env])), where
        if isinstance(config, ConfigInForce):
            path, raw = config.path, config.raw  # the one read of the file
        elif config is None or isinstance(config, str | os.PathLike):
            path = config_file_path(config, env)
            raw = read_config_file(path) if path is not None else {}
        else:
            path, raw = None, {}  # tables given as such name no file
        if path is not None and s.key in raw:
            where = f"{path}: {s.key}"
            return _validate(s, _from_file(s, raw[s.key])), where
    except _Bad as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return s.default, None


def proc_read_timeout_in_force(config: str | os.PathLike[str] | Tables | ConfigInForce
                               | None = None,
                               env: Mapping[str, str] | None = None) -> float:
    """``proc_read_timeout`` as the daemon resolves it: ``$GPUWATCH_PROC_READ_TIMEOUT``, else
    the config file's, else 2 s. A bad value is a `ConfigError` naming where it came from."""
    return float(_in_force("proc_read_timeout", config, env)[0])


def host_namespaces_in_force(config: str | os.PathLike[str] | Tables | ConfigInForce
                             | None = None,
                             env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """``host_namespaces`` as the daemon resolves it (``$GPUWATCH_HOST_NAMESPACES``, else the
    config file's, else off) and where it was set, for an error to name: a direct ``gpuwatch
    mode`` in the daemon's container runs its commands where the daemon would."""
    on, where = _in_force("host_namespaces", config, env)
    return bool(on), where or "host_namespaces"


def load_settings(
    flags: Mapping[str, Any] | None = None,
    *,
    config: str | None = None,
    env: Mapping[str, str] | None = None,
    default_config: str = DEFAULT_CONFIG_PATH,
    resolve_groups: bool = True,
) -> WatchSettings:
    """Resolve every setting: ``flags`` (None = not given) > ``env`` > file > default.

    ``config`` is ``--config``. The file's tables are validated here too, so a bad file
    fails before anything is bound or scanned. Raises `ConfigError` naming the key.
    """
    flags = flags or {}
    env = os.environ if env is None else env
    unknown_flags = sorted(set(flags) - set(BY_KEY))
    if unknown_flags:
        raise ValueError(f"not a setting: {unknown_flags[0]!r}")  # a programming error
    path = config_file_path(config, env, default_config)
    raw: Mapping[str, Any] = {}
    tables: Tables | None = None
    identity: FileIdentity | None = None
    if path is not None:
        # Read and parsed once, for the options and the tables.
        read = config_in_force(path, env, default_config)
        raw, identity, tables = read.raw, read.identity, read.tables
    values: dict[str, Any] = {}
    origins: dict[str, Origin] = {}
    for s in SETTINGS:
        try:
            if flags.get(s.key) is not None:
                where = s.flag
                given = flags[s.key]
                # A flag's words are read as the environment's (one parser, one message),
                # not by argparse types of their own.
                typed = (_from_text(s, given) if isinstance(given, str) and s.kind != "str"
                         else _typed(s, given))
                value, origin = _validate(s, typed), "flag"
            elif s.env in env:
                where = f"environment {s.env}"
                value, origin = _validate(s, _from_text(s, env[s.env])), "env"
            elif s.key in raw:
                where = f"{path}: {s.key}"
                value, origin = _validate(s, _from_file(s, raw[s.key])), "file"
            else:
                value, origin = s.default, "default"
        except _Bad as exc:
            raise ConfigError(f"{where}: {exc}") from None
        values[s.key] = value
        origins[s.key] = origin  # type: ignore[assignment]
    settings = WatchSettings(**values, config_path=path, config_identity=identity,
                             origins=origins, loaded_tables=tables)
    if not resolve_groups:
        return settings
    return _with_groups(settings)


def _with_groups(settings: WatchSettings) -> WatchSettings:
    from dataclasses import replace

    gids: dict[str, int | None] = {}
    for key in ("socket_group", "switch_group"):
        name = getattr(settings, key)
        if name is None:
            # Only a group nobody named falls back to `gpuwatch`: one set empty (a blank
            # GPUWATCH_SOCKET_GROUP, a null in the file, --socket-group '') is turned off, as
            # every optional setting is, so an operator can keep the socket to root.
            unnamed = settings.origins.get(key, "default") == "default"
            gids[key] = default_socket_gid() if key == "socket_group" and unnamed else None
            continue
        try:
            gids[key] = resolve_group(name)
        except GroupNotFound as exc:
            where = where_set(key, settings.origins.get(key), settings.config_path)
            raise ConfigError(f"{where}: {exc}") from None
    return replace(settings, socket_gid=gids["socket_group"], switch_gid=gids["switch_group"])


# --------------------------------------------------------------------------- groups

#: Default group allowed to read through the socket, when it exists on the host.
DEFAULT_SOCKET_GROUP = "gpuwatch"


class GroupNotFound(CallerError, LookupError):
    """A group named in the settings does not exist on this host."""

    code = BAD_CONFIG


def resolve_group(name: str | int) -> int:
    """A group name or number as a gid; numbers need not exist in the database."""
    if isinstance(name, int):
        return _gid(name)
    text = name.strip()
    why = _group_problem(text)
    if why is not None:
        raise GroupNotFound(why)
    if text.isascii() and text.isdigit():
        return _gid(int(text))
    import grp  # here: only the daemon resolves groups

    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise GroupNotFound(f"group {text!r} does not exist on this host") from None


#: The largest gid: (gid_t)-1 means "no change" to chown.
_MAX_GID = 2**32 - 2


def _gid(number: int) -> int:
    if not 0 <= number <= _MAX_GID:
        raise GroupNotFound(f"group {number} is no gid (0-{_MAX_GID})")
    return number


def default_socket_gid() -> int | None:
    """The ``gpuwatch`` group when the host has one, else None (root only)."""
    import grp

    try:
        return grp.getgrnam(DEFAULT_SOCKET_GROUP).gr_gid
    except KeyError:
        return None


# --------------------------------------------------------------------------- the file and tables


#: A config file larger than this is refused: the whole of a real one is a few KiB.
CONFIG_MAX_BYTES = 1 << 20
#: Mappings and lists nested deeper than this are refused: a real config nests 2 levels.
CONFIG_MAX_DEPTH = 32
#: Values (keys, scalars, lists, mappings) a config file may hold once its aliases are
#: expanded: the embedded tables are a few dozen, a long vendor list a few hundred.
CONFIG_MAX_VALUES = 100_000


def _load_yaml_mapping(text: str, where: str) -> dict[str, Any]:
    """YAML with the C safe loader when PyYAML has it. Nesting is measured first from the
    parser's flat event stream (no recursion), so a deep file is refused before the
    recursive constructor could overflow the stack."""
    import yaml  # first use only: a lean `import gpuwatch`

    loader_class = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        _check_events(yaml, yaml.parse(text, Loader=loader_class), where)
        loader = loader_class(text)
        try:  # yaml.load, with the settings' scalars made text between compose and construct
            node = loader.get_single_node()
            if isinstance(node, yaml.MappingNode):
                _settings_as_text(yaml, loader, node)
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply") from None
    except (ValueError, OverflowError, TypeError, KeyError) as exc:
        # A scalar the parser took but no Python value holds (``2001-02-30``, ``!!int 0x``,
        # an integer of 5,000 digits, ``!!bool maybe``: a KeyError in PyYAML's bool table):
        # the file is wrong, so it is the file's error.
        reason = str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__
        raise ConfigError(f"{where}: a value YAML cannot read ({reason})") from None
    except yaml.YAMLError as exc:
        if "nesting depth" in str(getattr(exc, "problem", "")):
            # libyaml >= 0.2.5 (PyYAML 6.0.4 wheels) refuses deep flow nesting while scanning,
            # before the event stream above reaches our own limit: the same refusal.
            raise ConfigError(f"{where}: nested deeper than {CONFIG_MAX_DEPTH} levels") from None
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{where}: not valid YAML{at}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys at the top level")
    if _expanded_size(data) > CONFIG_MAX_VALUES:
        raise ConfigError(f"{where}: more than {CONFIG_MAX_VALUES} values once its aliases "
                          "are expanded")
    return data


_YAML_STR = "tag:yaml.org,2002:str"
_YAML_NULL = "tag:yaml.org,2002:null"
_YAML_NUMBERS = frozenset({"tag:yaml.org,2002:int", "tag:yaml.org,2002:float"})


def _settings_as_text(yaml: Any, loader: Any, root: Any) -> None:
    """Make the top-level settings' scalars text, as a flag and the environment give them,
    before YAML 1.1 types them: ``log_keep: 0x10`` would be 16, ``010`` octal 8, ``1:30``
    sexagesimal 90, ``5.0`` a float an integer setting took, and ``"5"`` a string it
    refused, where ``--log-keep`` refuses ``0x10`` and ``5.0``, reads ``010`` as 10 and
    takes ``5``. A number or boolean setting's scalar becomes its text whatever its tag (a
    null stays null: off), read later by the flag's rule (`_from_text`: ``verbose: 1`` and
    ``"yes"`` are true as ``GPUWATCH_VERBOSE=1`` is, where YAML gave an int and a string
    a boolean setting refused, and ``!!bool 1`` no KeyError); a string setting's scalar
    YAML took for a number (``socket_group: 0100``, gid 100, not 64) keeps its digits.
    Only the top-level mapping (its ``<<`` merges applied first) is touched: the tables
    keep their own rules."""
    loader.flatten_mapping(root)
    for index, (key, value) in enumerate(root.value):
        setting = (BY_KEY.get(key.value) if isinstance(key, yaml.ScalarNode)
                   and key.tag == _YAML_STR else None)
        if setting is None or not isinstance(value, yaml.ScalarNode):
            continue
        if setting.kind in ("int", "float", "bool"):
            retype = value.tag != _YAML_NULL
        elif setting.kind == "str" and value.tag in _YAML_NUMBERS:
            # Only as YAML inferred it: an explicit tag (``root: !!float abc``) stays the
            # writer's mistake, refused as YAML refuses it.
            plain = value.style in (None, "")  # "" from the C parser, None from Python's
            retype = value.tag == loader.resolve(yaml.ScalarNode, value.value, (plain, False))
        else:
            retype = False
        if retype:
            root.value[index] = (key, yaml.ScalarNode(_YAML_STR, value.value, value.start_mark,
                                                      value.end_mark, value.style))


def _check_events(yaml: Any, events: Iterable[Any], where: str) -> None:
    """Nesting and duplicate keys, from the parser's flat event stream (no recursion): a
    file nested too deep is refused before the recursive constructor could overflow the
    stack, and a key given twice (two ``root:`` lines), which YAML would settle silently by
    keeping the last, is the mistake it most likely is."""
    # One entry per open collection: the keys a mapping has seen and whether its next node
    # is a key (None for a sequence).
    open_: list[tuple[set[str], list[bool]] | None] = []

    def node_done() -> None:  # a value (or a key) of the enclosing mapping is complete
        if open_ and open_[-1] is not None:
            expecting = open_[-1][1]
            expecting[0] = not expecting[0]

    for event in events:
        if isinstance(event, yaml.MappingStartEvent | yaml.SequenceStartEvent):
            if len(open_) >= CONFIG_MAX_DEPTH:
                raise ConfigError(f"{where}: nested deeper than {CONFIG_MAX_DEPTH} levels")
            open_.append((set(), [True]) if isinstance(event, yaml.MappingStartEvent)
                         else None)
        elif isinstance(event, yaml.MappingEndEvent | yaml.SequenceEndEvent):
            open_.pop()
            node_done()
        elif isinstance(event, yaml.ScalarEvent | yaml.AliasEvent):
            top = open_[-1] if open_ else None
            if top is not None and top[1][0] and isinstance(event, yaml.ScalarEvent):
                key = event.value
                if key in top[0] and key != "<<":
                    raise ConfigError(f"{where}: key {key[:60]!r} given twice")
                top[0].add(key)
            node_done()


def _expanded_size(data: Any) -> int:
    """How many values ``data`` holds with every YAML alias expanded, counted without
    expanding: an aliased node is one shared object, counted once and multiplied. Whatever
    walks the file later (validation, a repr) walks the expanded size."""
    sizes: dict[int, int] = {}

    def size(value: Any) -> int:
        if not isinstance(value, dict | list):
            return 1
        known = sizes.get(id(value))
        if known is None:
            # An alias inside its own anchor (``&a [*a]``) makes a list that holds itself:
            # met again while it is being counted, it counts as too many, never recursing.
            sizes[id(value)] = CONFIG_MAX_VALUES + 1
            # nesting is otherwise at most CONFIG_MAX_DEPTH here: the recursion is bounded
            inner = ([*value.keys(), *value.values()] if isinstance(value, dict) else value)
            known = sizes[id(value)] = 1 + sum(size(v) for v in inner)
        return known

    return size(data)


def embedded_tables_raw() -> dict[str, Any]:
    """The embedded tables from their pre-compiled JSON form (``data/tables.json``, tested to
    equal ``data/tables.yaml``, the source): a direct probe parses no YAML at start-up."""
    import json
    from importlib import resources

    text = resources.files("gpuwatch").joinpath("data/tables.json").read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The raw mapping of a config file; every failure is a one-line `ConfigError`.

    A regular file of at most `CONFIG_MAX_BYTES`, opened without blocking: a FIFO, socket
    or device node at the path is an error at once, never a hang.
    """
    return read_config_file_as_read(path)[0]


def read_config_file_as_read(path: str | os.PathLike[str]
                             ) -> tuple[dict[str, Any], FileIdentity]:
    """`read_config_file`, and the `file_identity` of what was read, taken from the open
    descriptor before its first read: a file written or replaced since shows other
    numbers, so nothing is taken for the file the daemon checked unless it is that file."""
    try:
        # Checked before the open (a device node's open runs its driver) and on the fd.
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ConfigError(f"{path}: not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"{path}: not a regular file")
            # The file decides where root writes its log, who may switch, which GPUs are
            # kept for the host: one another user may write or replace is not trusted.
            why = others_may_write(st) or others_choose(os.fspath(path))
            if why is not None:
                why = why if why.startswith("/") else f"it {why}"
                raise ConfigError(f"{path}: {why}, so another user could write this "
                                  "configuration; not reading it")
            data = b""
            while len(data) <= CONFIG_MAX_BYTES:
                chunk = os.read(fd, CONFIG_MAX_BYTES + 1 - len(data))
                if not chunk:
                    break
                data += chunk
        finally:
            os.close(fd)
        if len(data) > CONFIG_MAX_BYTES:
            raise ConfigError(f"{path}: larger than {CONFIG_MAX_BYTES} bytes")
        text = data.decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from None
    return _load_yaml_mapping(text, str(path)), file_identity(st)


def build_tables(overrides: Mapping[str, Any], where: str = "config") -> Tables:
    """Embedded tables with each given key replacing the embedded one whole."""
    from pydantic import ValidationError

    from gpuwatch.core.tables import Tables

    merged = embedded_tables_raw()
    for key in TABLE_KEYS:
        if key in overrides:
            merged[key] = overrides[key]
    try:
        return Tables.model_validate(merged)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"{where}: {loc}: {err['msg']}") from None


def load_tables(config: str | os.PathLike[str] | Tables | None = None) -> Tables:
    """The tables in force: embedded, or overridden key by key from ``config``.

    Unknown top-level keys are reported rather than ignored: a typo like ``gpu_vendor``
    would otherwise silently do nothing. Tables given as such are returned as they are.
    """
    if config is None:
        return default_tables()
    if not isinstance(config, str | os.PathLike):
        return config
    raw = read_config_file(config)
    return build_tables(_only_table_keys(raw, str(config)), str(config))


def _only_table_keys(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The table keys of a config file, once every other key is known to be an option with
    a good value: a file the daemon would refuse (``root: [1, 2]``, ``log_keep: 0``) is
    refused by every command that reads it, not half-used."""
    unknown = sorted(set(raw) - set(TABLE_KEYS) - set(SETTING_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}")
    for s in SETTINGS:
        if s.key in raw:
            try:
                _validate(s, _from_file(s, raw[s.key]))
            except _Bad as exc:
                raise ConfigError(f"{where}: {s.key}: {exc}") from None
    return {k: v for k, v in raw.items() if k in TABLE_KEYS}


_DEFAULT: Tables | None = None


def default_tables() -> Tables:
    """The embedded tables, parsed once on first use."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = build_tables({}, "embedded tables")
    return _DEFAULT


__all__ = [
    "CONFIG_ENV",
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_SOCKET_GROUP",
    "ENV_PREFIX",
    "MIN_NFD_EXPIRY",
    "ROOT_ENV",
    "SETTINGS",
    "SETTING_KEYS",
    "TABLE_KEYS",
    "ConfigError",
    "ConfigInForce",
    "FileIdentity",
    "GroupNotFound",
    "InvalidListenAddress",
    "Setting",
    "WatchSettings",
    "build_tables",
    "config_file_path",
    "config_in_force",
    "default_socket_gid",
    "default_tables",
    "file_identity",
    "host_namespaces_in_force",
    "load_settings",
    "load_tables",
    "parse_listen_address",
    "proc_read_timeout_in_force",
    "read_config_file",
    "read_config_file_as_read",
    "read_once",
    "resolve_group",
    "root_and_where",
    "root_in_force",
    "tables_in_force",
    "where_set",
]
